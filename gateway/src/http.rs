//! Small HTTP helpers both listeners use: a complete response in one call, the hop-by-hop
//! header set that never crosses the proxy, and how a connection's read and write buffers
//! are reused from one request to the next (client and engine connections alike).

use bytes::{Bytes, BytesMut};
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;

/// Make room in a connection's read buffer before a read of up to `bytes`. An empty buffer
/// goes back to the start of its allocation when nothing else holds a part of it, so every
/// request reads into the same (cached) memory instead of marching through the buffer;
/// otherwise reads go on into the free end while a quarter of `bytes` is left, and only then
/// is room reserved (which allocates anew while a request in progress holds the front).
pub(crate) fn make_read_room(buf: &mut BytesMut, bytes: usize) {
    if buf.is_empty() && buf.try_reclaim(bytes) {
        return;
    }
    if buf.capacity() - buf.len() < bytes / 4 {
        buf.reserve(bytes);
    }
}

/// The largest write buffer a connection keeps between uses (a client connection's response
/// head and inlined chunks, an engine connection's request); a larger one is let go rather
/// than held through the connection's idle time.
pub(crate) const KEEP_WRITE_BYTES: usize = 8 * 1024;

/// Empty a connection's write buffer for its next use, keeping the allocation unless it grew
/// past [`KEEP_WRITE_BYTES`].
pub(crate) fn recycle_write_buffer(buf: &mut BytesMut) {
    if buf.capacity() > KEEP_WRITE_BYTES {
        *buf = BytesMut::new();
    } else {
        buf.clear();
    }
}

/// Whether `name` (in any case) names a header that describes one hop and is never
/// forwarded (RFC 9110 §7.6.1: `connection`, `keep-alive`, `proxy-connection`,
/// `transfer-encoding`, `te`, `trailer`, `upgrade`; plus `host` and `content-length`, which
/// the gateway sets itself). By its length first, so one comparison at most where a scan of
/// the list takes nine (every header of every request and response passes here); a test
/// holds it to the list.
pub(crate) fn is_hop_by_hop(name: &[u8]) -> bool {
    let candidate: &[u8] = match name.len() {
        2 => b"te",
        4 => b"host",
        7 if name[0].eq_ignore_ascii_case(&b'u') => b"upgrade",
        7 => b"trailer",
        10 if name[0].eq_ignore_ascii_case(&b'c') => b"connection",
        10 => b"keep-alive",
        14 => b"content-length",
        16 => b"proxy-connection",
        17 => b"transfer-encoding",
        _ => return false,
    };
    name.eq_ignore_ascii_case(candidate)
}

/// Whether a response with `status` may carry `Content-Length`: never a 1xx or a 204
/// (RFC 9110 §8.6).
pub(crate) fn may_carry_length(status: u16) -> bool {
    status >= 200 && status != 204
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_buffer_rewinds_when_empty_and_alone_and_grows_only_when_nearly_full() {
        let mut buf = BytesMut::new();
        make_read_room(&mut buf, 1024);
        let start = buf.as_ptr();
        assert!(buf.capacity() >= 1024);
        // A request read and consumed: the next read starts at the front again.
        buf.extend_from_slice(&[b'x'; 600]);
        let _ = buf.split_to(600);
        make_read_room(&mut buf, 1024);
        assert_eq!((buf.as_ptr(), buf.capacity() >= 1024), (start, true));
        // A head still held by the request in progress: reads go on behind it, no new buffer.
        buf.extend_from_slice(&[b'x'; 600]);
        let head = buf.split_to(600).freeze();
        make_read_room(&mut buf, 1024);
        assert_eq!(buf.as_ptr(), start.wrapping_add(600));
        // Until less than a quarter is left: then room is made elsewhere.
        buf.extend_from_slice(&[b'y'; 300]);
        let _rest = buf.split_to(300);
        assert!(buf.capacity() < 256);
        make_read_room(&mut buf, 1024);
        assert!(buf.capacity() >= 1024);
        drop(head);
    }

    /// The hop-by-hop headers, as [`is_hop_by_hop`]'s documentation lists them.
    const HOP_BY_HOP: &[&str] = &[
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

    #[test]
    fn the_hop_by_hop_check_agrees_with_the_list() {
        let list = |n: &[u8]| HOP_BY_HOP.iter().any(|h| h.as_bytes().eq_ignore_ascii_case(n));
        let mut names: Vec<Vec<u8>> = HOP_BY_HOP.iter().map(|h| h.as_bytes().to_vec()).collect();
        for h in HOP_BY_HOP {
            names.push(h.to_ascii_uppercase().into_bytes());
            // Same length, one byte off, in every position.
            for i in 0..h.len() {
                let mut near = h.as_bytes().to_vec();
                near[i] = if near[i] == b'x' { b'y' } else { b'x' };
                names.push(near);
            }
            names.push(h.as_bytes()[1..].to_vec());
            names.push([h.as_bytes(), b"s"].concat());
        }
        for other in
            ["", "t", "tf", "ups", "content-type", "x-request-id", "cookie", "Upgrade", "TRAILER", "Keep-Alive"]
        {
            names.push(other.as_bytes().to_vec());
        }
        for n in names {
            assert_eq!(is_hop_by_hop(&n), list(&n), "{}", String::from_utf8_lossy(&n));
        }
    }
}
