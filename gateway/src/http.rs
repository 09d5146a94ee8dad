//! Small HTTP helpers both listeners use: a complete response in one call, and the
//! hop-by-hop header set that never crosses the proxy.

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;

/// Headers that describe one hop and are never forwarded (RFC 9110 §7.6.1, plus `host` and
/// `content-length`, which the gateway sets itself).
pub(crate) const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
];

/// Write a complete small response; true when it was written.
pub(crate) async fn respond(
    s: &mut ServerSession,
    status: u16,
    content_type: &str,
    body: Bytes,
    retry_after: Option<u64>,
) -> bool {
    let Ok(mut resp) = ResponseHeader::build(status, Some(4)) else { return false };
    let _ = resp.insert_header("content-type", content_type);
    let _ = resp.insert_header("content-length", body.len().to_string());
    if let Some(secs) = retry_after {
        let _ = resp.insert_header("retry-after", secs.to_string());
    }
    s.write_response_header(Box::new(resp)).await.is_ok() && s.write_response_body(body, true).await.is_ok()
}
