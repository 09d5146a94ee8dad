//! The proxy: every request the sidecar does not answer itself goes to the engine, unbuffered,
//! if [`super::access`] allows it.
//!
//! - A refused path is answered 403 in the OpenAI error shape (type `permission_error`) and
//!   counted on `switchyard_shim_refused_requests_total`; nothing reaches the engine.
//! - The request is forwarded as it came (method, headers, body streamed) to the same path
//!   and query on the engine, with `Host` set to the engine's authority, over HTTP/1.1.
//! - The engine's response is passed back frame by frame ([`Tracked`]), so an SSE stream
//!   reaches the client chunk by chunk as the engine writes it.
//! - The request counts in flight ([`super::in_flight`]) from its arrival until the response
//!   body ends or is dropped, and the time to the first data frame is observed on
//!   `switchyard_shim_ttft_seconds`.
//! - An engine that cannot be reached answers 502 with the OpenAI error shape
//!   ([`crate::openai_error::error_body`], type `service_unavailable`, no code).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, Incoming};

use super::access::{Access, ADMIN_TOKEN_HEADER};
use super::in_flight::InFlightGuard;
use super::Sidecar;
use crate::openai_error::error_body;

/// `engine`'s scheme and authority with `path_and_query`.
pub(crate) fn engine_uri(engine: &Uri, path_and_query: &str) -> Result<Uri, axum::http::Error> {
    let mut parts = engine.clone().into_parts();
    parts.path_and_query = Some(path_and_query.parse()?);
    Ok(Uri::from_parts(parts)?)
}

/// The 502 answer when the engine cannot be reached.
pub(crate) fn engine_unreachable(why: &dyn std::fmt::Display) -> Response {
    let body = error_body(&format!("engine unreachable: {why}"), "service_unavailable", None, None);
    (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
}

/// The 403 answer for a path the sidecar does not forward.
pub(crate) fn path_refused(path: &str) -> Response {
    let msg = format!(
        "{path} is not forwarded to the engine: only inference routes are (the sidecar's --allow-path widens that)"
    );
    (StatusCode::FORBIDDEN, axum::Json(error_body(&msg, "permission_error", None, None))).into_response()
}

/// The engine's response body, passed through frame by frame, holding its request's
/// in-flight unit until it ends or is dropped.
struct Tracked {
    inner: Incoming,
    started: Instant,
    /// Taken when the first data frame arrives, so TTFT is observed once.
    ttft: Option<prometheus::Histogram>,
    _in_flight: InFlightGuard,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &polled {
            if f.is_data() {
                if let Some(h) = self.ttft.take() {
                    h.observe(self.started.elapsed().as_secs_f64());
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

/// The fallback handler: forward `req` to the engine and stream its answer back.
pub(crate) async fn proxy(State(sh): State<Arc<Sidecar>>, req: Request) -> Response {
    let started = Instant::now();
    let token = req.headers().get(ADMIN_TOKEN_HEADER).map(|v| v.as_bytes());
    if sh.config.access.decide(req.uri().path(), token) == Access::Refuse {
        sh.refused.inc();
        return path_refused(req.uri().path());
    }
    let guard = sh.in_flight.enter();
    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
    let (mut parts, body) = req.into_parts();
    parts.headers.remove(ADMIN_TOKEN_HEADER);
    parts.uri = match engine_uri(&sh.config.engine, &pq) {
        Ok(u) => u,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("bad request target: {e}")).into_response(),
    };
    parts.headers.remove(header::HOST);
    if let Some(h) = sh.config.engine.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()) {
        parts.headers.insert(header::HOST, h);
    }
    parts.version = axum::http::Version::HTTP_11;
    match sh.client.request(axum::http::Request::from_parts(parts, body)).await {
        Ok(resp) => {
            let (parts, inner) = resp.into_parts();
            let body = Tracked { inner, started, ttft: Some(sh.ttft.clone()), _in_flight: guard };
            Response::from_parts(parts, Body::new(body))
        }
        Err(e) => engine_unreachable(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_uri_keeps_the_engine_and_takes_the_path_and_query() {
        let engine: Uri = "http://10.0.0.7:8000".parse().unwrap();
        let u = engine_uri(&engine, "/v1/completions?x=1").unwrap();
        assert_eq!(u.to_string(), "http://10.0.0.7:8000/v1/completions?x=1");
        assert!(engine_uri(&engine, "no spaces allowed here ").is_err());
    }
}
