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

/// Client headers that never reach an engine: credentials and session state meant for the
/// edge (with API keys on, `authorization` is the tenant's key and is dropped too).
pub(crate) const EDGE_ONLY: &[&str] = &["proxy-authorization", "cookie"];

/// The request id header: a client's is kept, else the gateway makes one; the engine gets
/// it, the access log records it and the response carries it back.
pub(crate) const REQUEST_ID: &str = "x-request-id";

/// Write a complete small response; true when it was written.
pub(crate) async fn respond(
    s: &mut ServerSession,
    status: u16,
    content_type: &str,
    body: Bytes,
    retry_after: Option<u64>,
) -> bool {
    respond_with(s, status, content_type, body, retry_after, None).await
}

/// [`respond`] carrying the request's id back.
pub(crate) async fn respond_with(
    s: &mut ServerSession,
    status: u16,
    content_type: &str,
    body: Bytes,
    retry_after: Option<u64>,
    request_id: Option<&str>,
) -> bool {
    let retry_after = retry_after.map(|secs| secs.to_string());
    let headers = [("retry-after", retry_after.as_deref()), (REQUEST_ID, request_id)];
    let present: Vec<(&'static str, &str)> = headers.iter().filter_map(|(k, v)| v.map(|v| (*k, v))).collect();
    respond_headers(s, status, content_type, body, &present).await
}

/// A whole response with `headers` besides the content type and length; true when it was
/// written.
pub(crate) async fn respond_headers(
    s: &mut ServerSession,
    status: u16,
    content_type: &str,
    body: Bytes,
    headers: &[(&'static str, &str)],
) -> bool {
    let Ok(mut resp) = ResponseHeader::build(status, Some(4 + headers.len())) else { return false };
    for (name, value) in headers {
        let _ = resp.insert_header(*name, *value);
    }
    let _ = resp.insert_header("content-type", content_type);
    let _ = resp.insert_header("content-length", body.len().to_string());
    s.write_response_header(Box::new(resp)).await.is_ok() && s.write_response_body(body, true).await.is_ok()
}
