//! The heads of the engine leg: the request head the gateway writes (straight into bytes,
//! no header map built for it) and the response head it parses. Pure.

use std::ops::Range;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::downstream::RequestHead;
use crate::framing::{content_length, Framing};
use crate::http::{is_hop_by_hop, EDGE_ONLY, REQUEST_ID};

/// The most response header fields read from an engine.
const MAX_RESPONSE_HEADERS: usize = 128;
/// The largest response head read from an engine.
pub const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// What the gateway tells an engine about where a request came from.
pub(crate) struct Forwarded<'a> {
    /// The client's address (appended to `X-Forwarded-For`).
    pub peer: Option<std::net::IpAddr>,
    /// `http` or `https`: how the client reached the gateway.
    pub proto: &'static str,
    /// `X-Request-Id`.
    pub request_id: &'a str,
    /// API keys are on: `Authorization` is the tenant's key to the gateway, not the engine's.
    pub strip_authorization: bool,
}

/// A request the gateway cannot put on the wire as it is.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0} holds a byte an HTTP/1.1 request line cannot carry")]
pub struct Unwritable(&'static str);

/// Append the engine-bound request head for `client`'s request to `out`: the client's
/// end-to-end headers — never hop-by-hop ones, nor those the client's `Connection` names,
/// nor the edge's credentials ([`EDGE_ONLY`], and `Authorization` when keys are on), nor
/// `Expect` (the gateway answers `100-continue` itself and sends the body whole), nor a
/// name with an underscore (`Transfer_Encoding`: stacks that map `_` to `-` would read a
/// framing field; NGINX drops them too) — plus
/// our host, length, `X-Forwarded-For` (the client's chain with its address appended),
/// `X-Forwarded-Proto` and `X-Request-Id`. Header names go out in lower case.
pub(crate) fn request_head(
    out: &mut BytesMut,
    client: &RequestHead,
    path: &str,
    authority: &str,
    body_len: usize,
    fwd: &Forwarded<'_>,
) -> Result<(), Unwritable> {
    for (what, value) in [("the path", path), ("the engine's authority", authority), ("the request id", fwd.request_id)]
    {
        if value.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err(Unwritable(what));
        }
    }
    out.reserve(256 + path.len() + client.size());
    put(out, &[b"POST ", path.as_bytes(), b" HTTP/1.1\r\nhost: ", authority.as_bytes(), b"\r\n"]);
    // Fields the client's `Connection` names (looked for only when it has one).
    let has_connection = client.get("connection").is_some();
    let named = |n: &[u8]| {
        has_connection
            && client
                .get_all("connection")
                .flat_map(|v| v.split(|&b| b == b','))
                .any(|c| c.trim_ascii().eq_ignore_ascii_case(n))
    };
    let mut chain: Option<Vec<&[u8]>> = None;
    for (name, value) in client.fields() {
        if name == b"x-forwarded-for" {
            chain.get_or_insert_with(Vec::new).push(value);
            continue;
        }
        let dropped = is_hop_by_hop(name)
            || EDGE_ONLY.iter().any(|h| h.as_bytes() == name)
            || (fwd.strip_authorization && name == b"authorization")
            || name == b"x-forwarded-proto"
            || name == REQUEST_ID.as_bytes()
            || name == b"expect"
            || name.contains(&b'_')
            || named(name);
        if !dropped {
            put(out, &[name, b": ", value, b"\r\n"]);
        }
    }
    put(out, &[b"content-length: ", itoa::Buffer::new().format(body_len).as_bytes(), b"\r\n"]);
    if let Some(peer) = fwd.peer {
        out.put_slice(b"x-forwarded-for: ");
        let prior: Vec<&[u8]> = chain.unwrap_or_default().into_iter().filter(|c| !c.trim_ascii().is_empty()).collect();
        for c in &prior {
            put(out, &[c, b", "]);
        }
        put_ip(out, peer);
        out.put_slice(b"\r\n");
    }
    put(out, &[b"x-forwarded-proto: ", fwd.proto.as_bytes(), b"\r\n"]);
    if !fwd.request_id.is_empty() {
        put(out, &[b"x-request-id: ", fwd.request_id.as_bytes(), b"\r\n"]);
    }
    out.put_slice(b"\r\n");
    Ok(())
}

/// An address as `Display` writes it; IPv4 (the common case) without the formatter.
fn put_ip(out: &mut BytesMut, ip: std::net::IpAddr) {
    match ip {
        std::net::IpAddr::V4(v4) => {
            let mut digits = itoa::Buffer::new();
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.put_u8(b'.');
                }
                out.put_slice(digits.format(octet).as_bytes());
            }
        }
        std::net::IpAddr::V6(_) => {
            use std::fmt::Write;
            let _ = write!(out, "{ip}");
        }
    }
}

fn put(out: &mut BytesMut, parts: &[&[u8]]) {
    for p in parts {
        out.put_slice(p);
    }
}

/// An engine's response head.
#[derive(Debug)]
pub(crate) struct ResponseHead {
    /// The status code.
    pub status: u16,
    /// The head's bytes (names lower-cased), which `fields` point into.
    raw: Bytes,
    /// The end-to-end fields as the engine sent them (hop-by-hop ones dropped, and the
    /// `Content-Length`, which [`ResponseHead::framing`] carries): name and value spans.
    fields: Vec<(Range<usize>, Range<usize>)>,
    /// How the body's end is known.
    pub framing: Framing,
    /// The engine keeps the connection open after this response.
    pub keepalive: bool,
    /// `Content-Type: text/event-stream`.
    pub is_sse: bool,
}

impl ResponseHead {
    /// The end-to-end fields, names in lower case, in the order sent.
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.fields.iter().map(|(n, v)| (&self.raw[n.clone()], &self.raw[v.clone()]))
    }
}

/// A response head the gateway does not accept.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HeadError {
    #[error("malformed response head: {0}")]
    Malformed(String),
    #[error("response head over {MAX_RESPONSE_HEAD} bytes")]
    TooLarge,
    #[error("invalid or conflicting Content-Length")]
    Length,
    #[error("interim response {0} is not supported")]
    Upgrade(u16),
}

/// Parse the response head at the front of `buf` and take it out of `buf` (header values
/// are slices of one copy of the head), or `None` when it is not complete yet. Interim (1xx)
/// responses are for the caller to skip.
pub(crate) fn parse_response_head(buf: &mut BytesMut) -> Result<Option<ResponseHead>, HeadError> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
    let mut resp = httparse::Response::new(&mut fields);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_RESPONSE_HEAD => return Err(HeadError::TooLarge),
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(HeadError::Malformed(e.to_string())),
    };
    let status = resp.code.unwrap_or(0);
    if status == 101 {
        return Err(HeadError::Upgrade(status));
    }
    let http11 = resp.version == Some(1);
    let (mut chunked, mut transfer_encoding, mut length) = (false, false, None::<u64>);
    let (mut close, mut keep_alive, mut is_sse) = (false, false, false);
    let start = buf.as_ptr() as usize;
    let span = |b: &[u8]| b.as_ptr() as usize - start..b.as_ptr() as usize - start + b.len();
    let mut kept = Vec::with_capacity(resp.headers.len());
    for h in resp.headers.iter() {
        // httparse checked the name is a token and the value has no control bytes.
        let n = h.name.as_bytes();
        // By length first: one comparison at most per field.
        match n.len() {
            14 if n.eq_ignore_ascii_case(b"content-length") => {
                let v = content_length(h.value.trim_ascii());
                match (v, length) {
                    (Some(v), None) => length = Some(v),
                    (Some(v), Some(l)) if v == l => {}
                    _ => return Err(HeadError::Length),
                }
                continue;
            }
            17 if n.eq_ignore_ascii_case(b"transfer-encoding") => {
                transfer_encoding = true;
                // The last coding decides (RFC 9112 §6.3).
                let last = h.value.rsplit(|&b| b == b',').next().unwrap_or_default();
                chunked = last.trim_ascii().eq_ignore_ascii_case(b"chunked");
            }
            10 if n.eq_ignore_ascii_case(b"connection") => {
                for token in h.value.split(|&b| b == b',') {
                    close |= token.trim_ascii().eq_ignore_ascii_case(b"close");
                    keep_alive |= token.trim_ascii().eq_ignore_ascii_case(b"keep-alive");
                }
            }
            12 if n.eq_ignore_ascii_case(b"content-type") => is_sse = h.value.starts_with(b"text/event-stream"),
            _ => {}
        }
        if !is_hop_by_hop(n) {
            kept.push((span(n), span(h.value)));
        }
    }
    let framing = if (100..200).contains(&status) || status == 204 || status == 304 {
        Framing::Length(0)
    } else if transfer_encoding {
        if chunked {
            Framing::Chunked
        } else {
            Framing::UntilClose
        }
    } else if let Some(n) = length {
        Framing::Length(n)
    } else {
        Framing::UntilClose
    };
    // Both framings at once is how request smuggling starts: chunked wins, and the
    // connection is not reused.
    // So is a chunked HTTP/1.0 response (RFC 9112 §6.1: the connection closes after it).
    let ambiguous = transfer_encoding && (length.is_some() || !http11);
    let keepalive = (if http11 { !close } else { keep_alive }) && framing != Framing::UntilClose && !ambiguous;
    // One copy of the head for the fields to point into: `buf` stays the connection's own,
    // reused for the next response instead of shared with a head the request holds.
    let mut raw = BytesMut::from(&buf[..len]);
    for (name, _) in &kept {
        raw[name.clone()].make_ascii_lowercase();
    }
    buf.advance(len);
    Ok(Some(ResponseHead { status, raw: raw.freeze(), fields: kept, framing, keepalive, is_sse }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(headers: &[(&str, &str)]) -> RequestHead {
        RequestHead::from_parts("POST", "/v1/completions", headers.iter().map(|(n, v)| (*n, v.as_bytes())))
    }

    /// The head `request_head` writes, parsed back: the request line and the fields.
    fn written(req: &RequestHead, fwd: &Forwarded<'_>) -> (String, Vec<(String, String)>) {
        let mut out = BytesMut::new();
        request_head(&mut out, req, "/v1/completions?x=1", "engine:8000", 7, fwd).unwrap();
        let mut fields = [httparse::EMPTY_HEADER; 64];
        let mut parsed = httparse::Request::new(&mut fields);
        assert_eq!(parsed.parse(&out).unwrap(), httparse::Status::Complete(out.len()));
        let line = format!("{} {}", parsed.method.unwrap(), parsed.path.unwrap());
        let fields =
            parsed.headers.iter().map(|h| (h.name.to_string(), String::from_utf8(h.value.to_vec()).unwrap())).collect();
        (line, fields)
    }

    fn get<'a>(fields: &'a [(String, String)], name: &str) -> Vec<&'a str> {
        fields.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_str()).collect()
    }

    #[test]
    fn engines_get_no_edge_credentials_and_learn_where_the_request_came_from() {
        let req = client(&[
            ("authorization", "Bearer sk-tenant"),
            ("proxy-authorization", "Basic x"),
            ("cookie", "session=1"),
            ("connection", "keep-alive, X-Secret"),
            ("x-secret", "1"),
            ("x-forwarded-for", "203.0.113.9"),
            ("x-forwarded-proto", "ftp"),
            ("x-request-id", "spoofed"),
            ("x-keep", "yes"),
            ("host", "gateway.example"),
            ("content-length", "999"),
            ("transfer-encoding", "chunked"),
            ("expect", "100-continue"),
            ("transfer_encoding", "chunked"),
            ("x_custom", "1"),
        ]);
        let fwd = Forwarded {
            peer: Some("10.0.0.5".parse().unwrap()),
            proto: "https",
            request_id: "abc",
            strip_authorization: true,
        };
        let (line, fields) = written(&req, &fwd);
        assert_eq!(line, "POST /v1/completions?x=1");
        // `Expect` is the gateway's to answer; names with `_` may read as framing fields to a
        // stack that maps `_` to `-`.
        for gone in [
            "authorization",
            "proxy-authorization",
            "cookie",
            "connection",
            "x-secret",
            "transfer-encoding",
            "expect",
            "transfer_encoding",
            "x_custom",
        ] {
            assert!(get(&fields, gone).is_empty(), "{gone} must not reach the engine");
        }
        assert_eq!(get(&fields, "x-forwarded-for"), ["203.0.113.9, 10.0.0.5"]);
        assert_eq!(get(&fields, "x-forwarded-proto"), ["https"]);
        assert_eq!(get(&fields, "x-request-id"), ["abc"]);
        assert_eq!(get(&fields, "x-keep"), ["yes"]);
        assert_eq!(get(&fields, "host"), ["engine:8000"]);
        assert_eq!(get(&fields, "content-length"), ["7"]);
        // Without API keys `Authorization` is the client's business with the engine.
        let open = Forwarded { strip_authorization: false, ..fwd };
        assert_eq!(get(&written(&req, &open).1, "authorization"), ["Bearer sk-tenant"]);
    }

    #[test]
    fn addresses_are_written_as_display_writes_them() {
        for ip in ["0.0.0.0", "10.0.0.5", "255.255.255.255", "192.168.100.9", "::1", "2001:db8::8a2e:370:7334"] {
            let ip: std::net::IpAddr = ip.parse().unwrap();
            let mut out = BytesMut::new();
            put_ip(&mut out, ip);
            assert_eq!(&out[..], ip.to_string().as_bytes());
        }
    }

    #[test]
    fn a_forwarded_chain_of_several_fields_is_joined_and_empty_ones_are_dropped() {
        let req = client(&[("x-forwarded-for", "1.1.1.1"), ("x-forwarded-for", " "), ("x-forwarded-for", "2.2.2.2")]);
        let fwd = Forwarded {
            peer: Some("::1".parse().unwrap()),
            proto: "http",
            request_id: "r",
            strip_authorization: false,
        };
        assert_eq!(get(&written(&req, &fwd).1, "x-forwarded-for"), ["1.1.1.1, 2.2.2.2, ::1"]);
    }

    #[test]
    fn a_path_or_authority_that_would_break_the_request_line_is_refused() {
        let req = client(&[]);
        let fwd = Forwarded { peer: None, proto: "http", request_id: "r", strip_authorization: false };
        let mut out = BytesMut::new();
        assert!(request_head(&mut out, &req, "/v1/a b", "e:1", 0, &fwd).is_err());
        assert!(request_head(&mut out, &req, "/v1/a", "e:1\r\nx: y", 0, &fwd).is_err());
    }

    /// The head parsed from `head`, and how many bytes of it were left after the head.
    fn parse(head: &str) -> Result<Option<(ResponseHead, usize)>, HeadError> {
        let mut buf = BytesMut::from(head.as_bytes());
        Ok(parse_response_head(&mut buf)?.map(|h| (h, buf.len())))
    }

    #[test]
    fn response_heads_say_their_framing_and_whether_the_connection_stays() {
        let (h, n) = parse(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\nbody",
        )
        .unwrap()
        .unwrap();
        assert_eq!((h.status, h.framing, h.keepalive, h.is_sse, n), (200, Framing::Chunked, true, true, 4));
        let fields: Vec<(&[u8], &[u8])> = h.fields().collect();
        assert_eq!(fields, [(&b"content-type"[..], &b"text/event-stream"[..]), (b"x-a", b"1")]);
        let (h, _) = parse("HTTP/1.1 200 OK\r\ncontent-length: 12\r\nConnection: close\r\n\r\n").unwrap().unwrap();
        assert_eq!((h.framing, h.keepalive), (Framing::Length(12), false));
        let (h, _) = parse("HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n").unwrap().unwrap();
        assert!(!h.keepalive, "HTTP/1.0 closes unless it says keep-alive");
        let (h, _) = parse("HTTP/1.0 200 OK\r\ncontent-length: 1\r\nconnection: keep-alive\r\n\r\n").unwrap().unwrap();
        assert!(h.keepalive);
        let (h, _) = parse("HTTP/1.1 200 OK\r\n\r\n").unwrap().unwrap();
        assert_eq!((h.framing, h.keepalive), (Framing::UntilClose, false));
        let (h, _) = parse("HTTP/1.1 204 No Content\r\n\r\n").unwrap().unwrap();
        assert_eq!((h.framing, h.keepalive), (Framing::Length(0), true));
        let (h, _) =
            parse("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n").unwrap().unwrap();
        assert_eq!((h.framing, h.keepalive), (Framing::Chunked, false), "both framings: chunked, and not reused");
        let (h, _) = parse("HTTP/1.1 100 Continue\r\n\r\n").unwrap().unwrap();
        assert_eq!(h.status, 100);
        let (h, _) =
            parse("HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n").unwrap().unwrap();
        assert_eq!((h.framing, h.keepalive), (Framing::Chunked, false), "a chunked HTTP/1.0 answer closes");
    }

    #[test]
    fn a_content_length_is_digits_only() {
        for bad in ["+350", "-1", "0x10", "1 2", "", "35O", "99999999999999999999"] {
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {bad}\r\n\r\n");
            assert_eq!(parse(&head).unwrap_err(), HeadError::Length, "{bad:?}");
        }
        let (h, _) = parse("HTTP/1.1 200 OK\r\ncontent-length:  350 \r\n\r\n").unwrap().unwrap();
        assert_eq!(h.framing, Framing::Length(350));
    }

    #[test]
    fn bad_heads_are_refused_and_partial_ones_wait() {
        assert!(parse("HTTP/1.1 200 OK\r\ncontent-le").unwrap().is_none());
        assert_eq!(
            parse("HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n").unwrap_err(),
            HeadError::Length
        );
        assert_eq!(parse("HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n").unwrap_err(), HeadError::Length);
        assert!(matches!(parse("garbage\r\n\r\n"), Err(HeadError::Malformed(_))));
        assert_eq!(parse("HTTP/1.1 101 Switching\r\n\r\n").unwrap_err(), HeadError::Upgrade(101));
        let huge = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_RESPONSE_HEAD));
        assert_eq!(parse(&huge).unwrap_err(), HeadError::TooLarge);
    }
}
