//! The client side of a request, whichever protocol carries it: [`Downstream`] is what the
//! request phases ([`crate::proxy`]) read the request from and write the response to.
//!
//! HTTP/1.1 — nearly all API traffic — is served by the gateway's own session ([`h1`]),
//! with the head parsed in place ([`head`]); HTTP/2 (ALPN `h2`, or h2c) by pingora's, its
//! head copied into the same [`RequestHead`] once per request.

pub(crate) mod h1;
pub(crate) mod head;

use std::net::IpAddr;

use bytes::{Bytes, BytesMut};
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;

pub(crate) use h1::{H1Connection, H1Request};
pub use head::RequestHead;

/// One request's client side.
pub(crate) enum Downstream<'c> {
    /// The gateway's HTTP/1.1 session.
    H1(H1Request<'c>),
    /// A pingora session (HTTP/2); boxed, it is much larger than the HTTP/1 side.
    Pingora(Box<PingoraRequest>),
}

/// A request on a pingora session, with its head in the gateway's shape.
pub(crate) struct PingoraRequest {
    session: ServerSession,
    head: RequestHead,
}

impl PingoraRequest {
    /// The request `session` has read.
    pub fn new(session: ServerSession) -> Self {
        let head = RequestHead::from_pingora(session.req_header());
        PingoraRequest { session, head }
    }

    /// The session, to finish it.
    pub fn into_session(self) -> ServerSession {
        self.session
    }
}

impl Downstream<'_> {
    /// The request head.
    pub fn head(&self) -> &RequestHead {
        match self {
            Downstream::H1(r) => r.head(),
            Downstream::Pingora(p) => &p.head,
        }
    }

    /// The client's address.
    pub fn peer(&self) -> Option<IpAddr> {
        match self {
            Downstream::H1(r) => r.peer(),
            Downstream::Pingora(p) => p.session.client_addr().and_then(|a| a.as_inet()).map(|a| a.ip()),
        }
    }

    /// The next piece of the request body; `None` at its end.
    ///
    /// # Errors
    /// The body is framed wrongly or the client left before its end.
    pub async fn read_body(&mut self) -> Result<Option<Bytes>, String> {
        match self {
            Downstream::H1(r) => r.read_body().await,
            Downstream::Pingora(p) => p.session.read_request_body().await.map_err(|e| e.to_string()),
        }
    }

    /// Whether the whole body has been read.
    pub fn is_body_done(&mut self) -> bool {
        match self {
            Downstream::H1(r) => r.is_body_done(),
            Downstream::Pingora(p) => p.session.is_body_done(),
        }
    }

    /// Resolves when the client has left (its body already read): watched while the
    /// engine works, so a client that leaves aborts the request.
    pub async fn closed(&mut self) {
        match self {
            Downstream::H1(r) => r.closed().await,
            Downstream::Pingora(p) => {
                let _ = p.session.read_body_or_idle(true).await;
            }
        }
    }

    /// Close the connection after this response.
    pub fn close_after(&mut self) {
        match self {
            Downstream::H1(r) => r.close_after(),
            Downstream::Pingora(p) => p.session.set_keepalive(None),
        }
    }

    /// Send the response head: `status`, `fields` (end-to-end ones; the framing is the
    /// session's) and the body's `length` when known. An HTTP/1.1 head leaves with the
    /// first body bytes (or [`Self::flush_head`]). False when the client is gone.
    pub async fn write_head<'f>(
        &mut self,
        status: u16,
        fields: impl IntoIterator<Item = (&'f [u8], &'f [u8])>,
        length: Option<usize>,
    ) -> bool {
        match self {
            Downstream::H1(r) => {
                r.write_head(status, fields, length);
                true
            }
            Downstream::Pingora(p) => {
                let Ok(mut resp) = ResponseHeader::build(status, None) else { return false };
                for (name, value) in fields {
                    let (Ok(name), Ok(value)) =
                        (http::HeaderName::from_bytes(name), http::HeaderValue::from_bytes(value))
                    else {
                        continue;
                    };
                    let _ = resp.append_header(name, value);
                }
                if let Some(n) = length {
                    if crate::http::may_carry_length(status) {
                        let _ = resp.insert_header(http::header::CONTENT_LENGTH, n);
                    }
                } else if !p.session.is_http2() && crate::http::may_carry_length(status) {
                    let _ = resp.insert_header(http::header::TRANSFER_ENCODING, "chunked");
                }
                p.session.write_response_header(Box::new(resp)).await.is_ok()
            }
        }
    }

    /// Send a head put by [`Self::write_head`] now, without waiting for body bytes.
    pub async fn flush_head(&mut self) -> bool {
        match self {
            Downstream::H1(r) => r.flush_head().await.is_ok(),
            Downstream::Pingora(_) => true,
        }
    }

    /// Write body bytes; `end`: the body is complete. False when the client is gone.
    pub async fn write_body(&mut self, data: Bytes, end: bool) -> bool {
        match self {
            Downstream::H1(r) => r.write_body(&data, end).await.is_ok(),
            Downstream::Pingora(p) => p.session.write_response_body(data, end).await.is_ok(),
        }
    }

    /// [`Self::write_body`] from a buffer the caller fills again: it is left empty, its
    /// allocation kept where the bytes were copied out (HTTP/1.1) rather than handed on.
    pub async fn write_body_from(&mut self, buf: &mut BytesMut, end: bool) -> bool {
        match self {
            Downstream::H1(r) => {
                let written = r.write_body(buf, end).await.is_ok();
                buf.clear();
                written
            }
            Downstream::Pingora(p) => p.session.write_response_body(buf.split().freeze(), end).await.is_ok(),
        }
    }

    /// A whole small response: `content_type`, `fields` besides it and the length, `body`.
    /// True when it was written.
    pub async fn respond(&mut self, status: u16, content_type: &str, body: Bytes, fields: &[(&str, &str)]) -> bool {
        let ct = [("content-type", content_type)];
        let all = ct.iter().chain(fields).map(|(n, v)| (n.as_bytes(), v.as_bytes()));
        self.write_head(status, all, Some(body.len())).await && self.write_body(body, true).await
    }
}
