//! The gateway's own HTTP/1.1 server side: one client connection ([`H1Connection`]) and
//! the request being served on it ([`H1Request`]).
//!
//! pingora's HTTP/1 session builds a header map for every request, re-serializes the
//! response through another, and sets up a session object per request — a fifth of the
//! gateway's instructions per proxied request. Here the head is parsed in place
//! ([`RequestHead`]), the response head is written straight into the output buffer, and
//! the connection's read buffer outlives its requests. pingora still accepts connections,
//! terminates TLS and serves HTTP/2; a TLS connection that did not negotiate `h2` comes
//! here like a cleartext one.
//!
//! The wire rules: the head is read within the header deadline and limits (431/400, then
//! the connection closes); the body by its framing (`Content-Length` or chunked, decoded by
//! the same [`BodyDecoder`] as engine responses), after a `100 Continue` when the client
//! asked for one; a response with a known length carries `Content-Length`, any other is
//! chunked (HTTP/1.0: delimited by closing); every response carries `Date` and
//! `Connection`. Bytes a client sends after its request's body (a pipelined request) are
//! kept for the next request, up to the head limit.

use std::io::{self, IoSlice};
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use bytes::{BufMut, Bytes, BytesMut};
use pingora::protocols::Stream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::head::{BodyFraming, RequestHead};
use crate::error::ProxyError;
use crate::framing::{BodyDecoder, Framing};

/// Room added to the read buffer before each read.
const READ_BYTES: usize = 8 * 1024;

/// How long a lingering close waits for the client's next bytes, and for all of them
/// (NGINX's `lingering_timeout` and `lingering_time`, shorter: the gateway only lingers
/// after refusing a request).
const LINGER_IDLE: Duration = Duration::from_secs(1);
const LINGER_TOTAL: Duration = Duration::from_secs(5);

/// One client connection: the stream and what was read from it but not used yet.
pub struct H1Connection {
    stream: Stream,
    buf: BytesMut,
    /// A response's head and framing, put before they leave with its body bytes; the
    /// allocation is reused by the connection's responses.
    out: BytesMut,
    peer: Option<IpAddr>,
    /// The `Date` value and the second it is for.
    date: (u64, [u8; 29]),
}

impl H1Connection {
    /// A connection over an accepted (maybe TLS) stream.
    pub fn new(stream: Stream) -> Self {
        let peer = stream.get_socket_digest().and_then(|d| d.peer_addr().and_then(|a| a.as_inet()).map(|a| a.ip()));
        H1Connection { stream, buf: BytesMut::new(), out: BytesMut::new(), peer, date: (0, [0; 29]) }
    }

    /// Whether bytes of a next request have arrived already.
    pub fn has_buffered(&self) -> bool {
        !self.buf.is_empty()
    }

    /// Wait until the client sends something; false when it closed the connection (or
    /// it failed).
    pub async fn wait_readable(&mut self) -> bool {
        crate::http::make_read_room(&mut self.buf, READ_BYTES);
        matches!(self.stream.read_buf(&mut self.buf).await, Ok(n) if n > 0)
    }

    /// Read a request head within `max_bytes` and `max_fields`. `Ok(None)`: the client
    /// closed the connection (or it failed) before a whole head arrived.
    ///
    /// # Errors
    /// A head the gateway refuses (431, 400); answer it with [`Self::refuse`].
    pub async fn read_head(&mut self, max_bytes: usize, max_fields: usize) -> Result<Option<RequestHead>, ProxyError> {
        loop {
            if !self.buf.is_empty() {
                if let Some(head) = RequestHead::parse(&mut self.buf, max_bytes, max_fields)? {
                    return Ok(Some(head));
                }
            }
            if !self.wait_readable().await {
                return Ok(None);
            }
        }
    }

    /// Answer a refused head with `e`'s OpenAI error body; the connection is closed after.
    pub async fn refuse(&mut self, e: &ProxyError) {
        let body = e.body();
        let mut out = BytesMut::with_capacity(256 + body.len());
        self.put_status_line(&mut out, e.status());
        put_fields(&mut out, &[(b"content-type", b"application/json"), (b"connection", b"close")]);
        put_length(&mut out, body.len());
        out.put_slice(b"\r\n");
        out.put_slice(body.as_bytes());
        let _ = self.write(&out, &Bytes::new()).await;
    }

    /// Close while the client may still be sending (a refused head, a body left unread):
    /// half-close the gateway's side, then read and drop what arrives until the client
    /// closes, pauses [`LINGER_IDLE`] or [`LINGER_TOTAL`] passes. Closing a socket with
    /// unread bytes sends a TCP reset, and a reset can destroy the answer before the client
    /// reads it (RFC 9112, section 9.6).
    pub async fn linger(mut self) {
        if self.stream.shutdown().await.is_err() {
            return;
        }
        let deadline = tokio::time::Instant::now() + LINGER_TOTAL;
        let mut sink = [0u8; READ_BYTES];
        while let Ok(Ok(Ok(n))) =
            tokio::time::timeout_at(deadline, tokio::time::timeout(LINGER_IDLE, self.stream.read(&mut sink))).await
        {
            if n == 0 {
                return;
            }
        }
    }

    /// Write `head` (framing included) then `data` — one vectored write when the socket
    /// takes them whole — and flush.
    async fn write(&mut self, mut head: &[u8], mut data: &[u8]) -> io::Result<()> {
        while !head.is_empty() || !data.is_empty() {
            let n = match (head.is_empty(), data.is_empty()) {
                (false, false) => self.stream.write_vectored(&[IoSlice::new(head), IoSlice::new(data)]).await?,
                (false, true) => self.stream.write(head).await?,
                _ => self.stream.write(data).await?,
            };
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            let from_head = n.min(head.len());
            head = &head[from_head..];
            data = &data[n - from_head..];
        }
        self.stream.flush().await
    }

    /// `HTTP/1.1 <status> <reason>`, then `Date`.
    fn put_status_line(&mut self, out: &mut BytesMut, status: u16) {
        let reason = http::StatusCode::from_u16(status).ok().and_then(|s| s.canonical_reason()).unwrap_or("Unknown");
        out.put_slice(b"HTTP/1.1 ");
        out.put_slice(itoa::Buffer::new().format(status).as_bytes());
        out.put_u8(b' ');
        out.put_slice(reason.as_bytes());
        out.put_slice(b"\r\ndate: ");
        out.put_slice(self.date());
        out.put_slice(b"\r\n");
    }

    /// Keep the written `out` buffer for the next response
    /// ([`crate::http::recycle_write_buffer`]).
    fn keep_out(&mut self, out: BytesMut) {
        self.out = out;
        crate::http::recycle_write_buffer(&mut self.out);
    }

    /// The `Date` value for now, formatted once a second.
    fn date(&mut self) -> &[u8] {
        let now = SystemTime::now();
        let secs = now.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if self.date.0 != secs {
            let text = httpdate::fmt_http_date(now);
            if text.len() == self.date.1.len() {
                self.date = (secs, [0; 29]);
                self.date.1.copy_from_slice(text.as_bytes());
            }
        }
        &self.date.1
    }
}

/// How the response body is being framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    /// No head written yet.
    Idle,
    /// `Content-Length`.
    Length,
    /// Chunked.
    Chunked,
    /// Until the connection closes (an HTTP/1.0 client, length unknown).
    UntilClose,
    /// No body may follow (`HEAD`, 204, 304).
    NoBody,
    /// The last body bytes were written.
    Ended,
}

/// The request being served on a connection.
pub struct H1Request<'c> {
    conn: &'c mut H1Connection,
    head: RequestHead,
    body: BodyDecoder,
    continue_due: bool,
    keepalive: bool,
    out: Out,
}

impl<'c> H1Request<'c> {
    /// Serve `head`, read from `conn`; `keepalive`: whether the gateway would keep the
    /// connection (the client's wish is applied here).
    pub fn new(conn: &'c mut H1Connection, head: RequestHead, keepalive: bool) -> Self {
        let framing = match head.body_framing() {
            BodyFraming::Length(n) => Framing::Length(n),
            BodyFraming::Chunked => Framing::Chunked,
        };
        let keepalive = keepalive && head.wants_keepalive();
        let continue_due = head.expects_continue();
        conn.out.clear();
        H1Request { conn, head, body: BodyDecoder::new(framing), continue_due, keepalive, out: Out::Idle }
    }

    /// The request head.
    pub fn head(&self) -> &RequestHead {
        &self.head
    }

    /// The client's address.
    pub fn peer(&self) -> Option<IpAddr> {
        self.conn.peer
    }

    /// Whether the whole body has been read.
    pub fn is_body_done(&self) -> bool {
        self.body.is_done()
    }

    /// Close the connection after this response.
    pub fn close_after(&mut self) {
        self.keepalive = false;
    }

    /// Whether the connection can serve another request: kept alive, body read, response
    /// ended.
    pub fn reusable(&self) -> bool {
        self.keepalive && self.body.is_done() && matches!(self.out, Out::Ended | Out::NoBody)
    }

    /// The next piece of the body; `None` at its end.
    ///
    /// # Errors
    /// A body framed wrongly, or a connection that closed before its end.
    pub async fn read_body(&mut self) -> Result<Option<Bytes>, String> {
        if self.continue_due && !self.body.is_done() {
            self.continue_due = false;
            if self.conn.buf.is_empty() {
                self.conn.write(b"HTTP/1.1 100 Continue\r\n\r\n", &[]).await.map_err(|e| e.to_string())?;
            }
        }
        loop {
            if self.body.is_done() {
                return Ok(None);
            }
            if let Some(data) = self.body.take_whole(&mut self.conn.buf) {
                return Ok(Some(data));
            }
            let mut data = BytesMut::new();
            self.body.decode(&mut self.conn.buf, &mut data).map_err(|e| e.to_string())?;
            if !data.is_empty() {
                return Ok(Some(data.freeze()));
            }
            if self.body.is_done() {
                return Ok(None);
            }
            if !self.conn.wait_readable().await {
                return Err("the client closed the connection before the body's end".into());
            }
        }
    }

    /// Resolves only when the client closes the connection (or it fails): what it sends
    /// meanwhile is kept as its next request, up to the head limit, after which it is no
    /// longer read.
    pub async fn closed(&mut self) {
        loop {
            if self.conn.buf.len() >= MAX_PIPELINED {
                std::future::pending::<()>().await;
            }
            if !self.conn.wait_readable().await {
                return;
            }
        }
    }

    /// Put the response head for `status` with `fields` (besides `Date`, `Connection` and
    /// the framing), its body `length` when known. It leaves with the first body write,
    /// or [`Self::flush_head`].
    pub fn write_head<'f>(
        &mut self,
        status: u16,
        fields: impl IntoIterator<Item = (&'f [u8], &'f [u8])>,
        length: Option<usize>,
    ) {
        if self.out != Out::Idle {
            return;
        }
        // A request whose body was not read leaves bytes the next head would be read from.
        if !self.body.is_done() {
            self.keepalive = false;
        }
        let no_body = self.head.method_is("HEAD") || status == 204 || status == 304;
        self.out = match length {
            _ if no_body => Out::NoBody,
            Some(_) => Out::Length,
            None if self.head.is_http10() => {
                self.keepalive = false;
                Out::UntilClose
            }
            None => Out::Chunked,
        };
        let mut out = std::mem::take(&mut self.conn.out);
        out.reserve(256);
        self.conn.put_status_line(&mut out, status);
        for (name, value) in fields {
            if !matches!(name, b"date" | b"connection" | b"keep-alive" | b"content-length" | b"transfer-encoding") {
                put_fields(&mut out, &[(name, value)]);
            }
        }
        let connection: &[u8] = if self.keepalive { b"keep-alive" } else { b"close" };
        put_fields(&mut out, &[(b"connection", connection)]);
        match (self.out, length) {
            (Out::Length, Some(n)) => put_length(&mut out, n),
            (Out::NoBody, Some(n)) if crate::http::may_carry_length(status) => put_length(&mut out, n),
            (Out::Chunked, _) => put_fields(&mut out, &[(b"transfer-encoding", b"chunked")]),
            _ => {}
        }
        out.put_slice(b"\r\n");
        self.conn.out = out;
    }

    /// Write the response head now (a stream whose first bytes are not here yet).
    ///
    /// # Errors
    /// The client is gone.
    pub async fn flush_head(&mut self) -> io::Result<()> {
        let head = std::mem::take(&mut self.conn.out);
        let written = self.conn.write(&head, &[]).await;
        self.conn.keep_out(head);
        written
    }

    /// Write `data` (with the head, if it has not left yet); `end`: the body is complete.
    ///
    /// # Errors
    /// The client is gone.
    pub async fn write_body(&mut self, data: &[u8], end: bool) -> io::Result<()> {
        let mut out = std::mem::take(&mut self.conn.out);
        let data = match self.out {
            Out::Chunked => {
                if !data.is_empty() {
                    put_chunk_size(&mut out, data.len());
                    if data.len() <= INLINE_BYTES {
                        out.put_slice(data);
                        out.put_slice(b"\r\n");
                    }
                }
                if data.len() > INLINE_BYTES {
                    // Large: the data leaves from its own buffer, its CRLF after it.
                    self.conn.write(&out, data).await?;
                    out.clear();
                    out.put_slice(b"\r\n");
                }
                if end {
                    out.put_slice(b"0\r\n\r\n");
                }
                &[][..]
            }
            Out::NoBody | Out::Ended | Out::Idle => &[][..],
            Out::Length | Out::UntilClose => data,
        };
        if end && self.out != Out::NoBody {
            self.out = Out::Ended;
        }
        if out.is_empty() && data.is_empty() {
            self.conn.keep_out(out);
            return Ok(());
        }
        let written = self.conn.write(&out, data).await;
        self.conn.keep_out(out);
        written
    }
}

/// The most bytes of a next request read while the current one is served.
const MAX_PIPELINED: usize = 64 * 1024;

/// Chunks up to this size are copied next to their size line (one buffer, one write).
const INLINE_BYTES: usize = 16 * 1024;

/// A chunk's size line: the length in hex, CRLF.
fn put_chunk_size(out: &mut BytesMut, n: usize) {
    let mut digits = [0u8; 16];
    let (mut i, mut n) = (digits.len(), n);
    loop {
        i -= 1;
        digits[i] = b"0123456789abcdef"[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.put_slice(&digits[i..]);
    out.put_slice(b"\r\n");
}

fn put_fields(out: &mut BytesMut, fields: &[(&[u8], &[u8])]) {
    for (name, value) in fields {
        out.put_slice(name);
        out.put_slice(b": ");
        out.put_slice(value);
        out.put_slice(b"\r\n");
    }
}

fn put_length(out: &mut BytesMut, n: usize) {
    out.put_slice(b"content-length: ");
    out.put_slice(itoa::Buffer::new().format(n).as_bytes());
    out.put_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt, DuplexStream};

    /// A connection whose client has sent `input` (and keeps its side open).
    async fn connection(input: &[u8]) -> (H1Connection, DuplexStream) {
        let (mut client, server) = duplex(1 << 20);
        client.write_all(input).await.unwrap();
        (H1Connection::new(Box::new(server)), client)
    }

    async fn body(r: &mut H1Request<'_>) -> Vec<u8> {
        let mut all = Vec::new();
        while let Some(b) = r.read_body().await.unwrap() {
            all.extend_from_slice(&b);
        }
        all
    }

    /// What the client has received so far.
    async fn received(client: &mut DuplexStream) -> String {
        let mut out = vec![0; 1 << 16];
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), client.read(&mut out)).await.unwrap().unwrap();
        String::from_utf8(out[..n].to_vec()).unwrap()
    }

    #[tokio::test]
    async fn pipelined_requests_are_read_one_after_the_other_with_their_bodies() {
        let input = b"POST /a HTTP/1.1\r\nHost: gw\r\nContent-Length: 3\r\n\r\nabcPOST /b HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nde\r\n1;x=y\r\nf\r\n0\r\nT: 1\r\n\r\nGET /c HTTP/1.1\r\nHost: gw\r\n\r\n";
        let (mut conn, _client) = connection(input).await;
        let mut seen = Vec::new();
        for _ in 0..3 {
            let head = conn.read_head(4096, 16).await.unwrap().unwrap();
            let mut r = H1Request::new(&mut conn, head, true);
            seen.push((r.head().path().to_string(), body(&mut r).await));
            assert!(r.is_body_done());
        }
        assert_eq!(seen, [("/a".into(), b"abc".to_vec()), ("/b".into(), b"def".to_vec()), ("/c".into(), vec![])]);
        assert!(!conn.has_buffered());
    }

    #[tokio::test]
    async fn a_known_length_leaves_with_its_head_in_one_write_and_keeps_the_connection() {
        let (mut conn, mut client) = connection(b"GET / HTTP/1.1\r\nHost: gw\r\n\r\n").await;
        let head = conn.read_head(4096, 16).await.unwrap().unwrap();
        let mut r = H1Request::new(&mut conn, head, true);
        r.write_head(200, [(&b"content-type"[..], &b"text/plain"[..]), (b"content-length", b"99")], Some(2));
        r.write_body(b"ok", true).await.unwrap();
        assert!(r.reusable());
        let got = received(&mut client).await;
        assert!(got.starts_with("HTTP/1.1 200 OK\r\ndate: "), "{got}");
        assert!(
            got.ends_with("\r\ncontent-type: text/plain\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\nok"),
            "{got}"
        );
        assert_eq!(got.matches("content-length").count(), 1, "the caller's length is not repeated: {got}");
    }

    #[tokio::test]
    async fn a_stream_is_chunked_for_http11_and_delimited_by_close_for_http10() {
        let (mut conn, mut client) = connection(b"POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: 0\r\n\r\n").await;
        let head = conn.read_head(4096, 16).await.unwrap().unwrap();
        let mut r = H1Request::new(&mut conn, head, true);
        r.write_head(200, [], None);
        r.flush_head().await.unwrap();
        assert!(received(&mut client).await.ends_with("transfer-encoding: chunked\r\n\r\n"));
        r.write_body(b"data: 1\n\n", false).await.unwrap();
        assert_eq!(received(&mut client).await, "9\r\ndata: 1\n\n\r\n");
        let big = vec![b'x'; INLINE_BYTES + 1];
        r.write_body(&big, true).await.unwrap();
        let mut got = String::new();
        while !got.ends_with("0\r\n\r\n") {
            got.push_str(&received(&mut client).await);
        }
        assert_eq!(got, format!("{:x}\r\n{}\r\n0\r\n\r\n", INLINE_BYTES + 1, "x".repeat(INLINE_BYTES + 1)));
        assert!(r.reusable());

        let (mut conn, mut client) = connection(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").await;
        let head = conn.read_head(4096, 16).await.unwrap().unwrap();
        let mut r = H1Request::new(&mut conn, head, true);
        r.write_head(200, [], None);
        r.write_body(b"raw", true).await.unwrap();
        let got = received(&mut client).await;
        assert!(
            got.contains("connection: close\r\n") && !got.contains("chunked") && got.ends_with("\r\n\r\nraw"),
            "{got}"
        );
        assert!(!r.reusable());
    }

    #[tokio::test]
    async fn continue_is_sent_before_the_body_is_read_and_an_unread_body_closes() {
        let (mut conn, mut client) =
            connection(b"POST / HTTP/1.1\r\nHost: gw\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n").await;
        let head = conn.read_head(4096, 16).await.unwrap().unwrap();
        let mut r = H1Request::new(&mut conn, head, true);
        let reading = tokio::spawn(async move {
            assert_eq!(received(&mut client).await, "HTTP/1.1 100 Continue\r\n\r\n");
            client.write_all(b"hi").await.unwrap();
            client
        });
        assert_eq!(body(&mut r).await, b"hi");
        let _client = reading.await.unwrap();

        let (mut conn, mut client) = connection(b"POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: 10\r\n\r\nabc").await;
        let head = conn.read_head(4096, 16).await.unwrap().unwrap();
        let mut r = H1Request::new(&mut conn, head, true);
        r.write_head(413, [], Some(0));
        r.write_body(b"", true).await.unwrap();
        assert!(received(&mut client).await.contains("connection: close\r\n"));
        assert!(!r.reusable(), "the rest of the body would be read as the next head");
    }

    #[tokio::test]
    async fn a_client_that_leaves_is_seen_and_one_that_pipelines_is_kept() {
        let (mut conn, mut client) = connection(b"GET / HTTP/1.1\r\nHost: gw\r\n\r\n").await;
        let head = conn.read_head(4096, 16).await.unwrap().unwrap();
        let mut r = H1Request::new(&mut conn, head, true);
        client.write_all(b"GET /next HTTP/1.1\r\nHost: gw\r\n\r\n").await.unwrap();
        let watch = tokio::time::timeout(std::time::Duration::from_millis(100), r.closed()).await;
        assert!(watch.is_err(), "more bytes are not the client leaving");
        drop(client);
        tokio::time::timeout(std::time::Duration::from_secs(5), r.closed()).await.unwrap();
        drop(r);
        assert_eq!(conn.read_head(4096, 16).await.unwrap().unwrap().path(), "/next");
    }

    #[tokio::test]
    async fn a_refused_head_is_answered_in_the_openai_shape_and_closed() {
        let (mut conn, mut client) = connection(b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n").await;
        let e = conn.read_head(4096, 16).await.unwrap_err();
        conn.refuse(&e).await;
        let got = received(&mut client).await;
        assert!(got.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{got}");
        assert!(got.contains("connection: close\r\n") && got.contains("\"error\""), "{got}");
    }

    #[test]
    fn chunk_sizes_are_hex() {
        for n in [0usize, 1, 9, 10, 15, 16, 255, 4096, 1 << 40] {
            let mut out = BytesMut::new();
            put_chunk_size(&mut out, n);
            assert_eq!(out, format!("{n:x}\r\n").as_bytes());
        }
    }
}
