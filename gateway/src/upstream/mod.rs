//! The engine leg's HTTP/1.1 client: one request and its response on a connection the
//! pool or the connector gave.
//!
//! The gateway speaks to engines itself rather than through pingora's HTTP/1 client, which
//! costs a quarter of the gateway's CPU per short streamed request: it writes the head and
//! the body in two writes (two TCP segments the engine must take), builds a header map with
//! case-preserved names for the head, and decodes the body one chunk per call with a timer
//! armed for each. Here the request leaves in one write ([`head::request_head`] writes
//! straight into bytes), the response head is parsed with `httparse` ([`head`]), and each
//! read decodes every body chunk it brought in one pass ([`body`]).
//!
//! The pure parts are [`head`] and [`body`]; [`EngineConnection`] is the thin I/O shell,
//! over a plain tokio socket for `http://` engines ([`EngineStream`]): pingora's stream
//! wrapper (a boxed trait object that times every read and write) cost ~800 instructions per
//! request there, and is kept for `https://` engines, whose TLS it brings.

pub(crate) mod head;

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::protocols::Stream;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::timeout;

pub(crate) use crate::framing::{BodyDecoder, BodyError, Framing, Progress};
pub(crate) use head::{request_head, Forwarded, HeadError, ResponseHead};

/// Room made before each read from an engine.
const READ_BYTES: usize = 16 * 1024;

/// Why an exchange with an engine failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EngineIoError {
    /// No response head (or no body bytes) within the deadline.
    #[error("timed out waiting for the engine")]
    ReadTimeout,
    /// The request could not be written within the deadline.
    #[error("timed out writing to the engine")]
    WriteTimeout,
    /// The engine closed the connection before the response ended.
    #[error("the engine closed the connection{}", if *.0 == 0 { String::new() } else { format!(" after {} response bytes", .0) })]
    Closed(usize),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Head(#[from] HeadError),
    #[error("{0}")]
    Body(#[from] BodyError),
}

/// The socket under an [`EngineConnection`].
pub enum EngineStream {
    /// An `http://` engine: the socket itself.
    Tcp(TcpStream),
    /// An `https://` engine: pingora's stream, with its TLS.
    Tls(Stream),
}

impl AsyncRead for EngineStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EngineStream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            EngineStream::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for EngineStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            EngineStream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            EngineStream::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            EngineStream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            EngineStream::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            EngineStream::Tcp(s) => s.is_write_vectored(),
            EngineStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EngineStream::Tcp(s) => Pin::new(s).poll_flush(cx),
            EngineStream::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EngineStream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            EngineStream::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// One connection to an engine, carrying one request at a time.
pub struct EngineConnection {
    stream: EngineStream,
    /// Bytes read and not yet consumed (the head, then the body's framing and data).
    read: BytesMut,
    /// The response body being read, once the head is in.
    body: Option<BodyDecoder>,
    /// The engine keeps the connection after the response.
    keepalive: bool,
    /// The request being sent (its head, and a small body behind it); the allocation is
    /// reused by the connection's requests.
    write: BytesMut,
}

impl crate::pool::Pooled for EngineConnection {
    type Io = EngineStream;
    fn stream_mut(&mut self) -> &mut EngineStream {
        &mut self.stream
    }
}

impl EngineConnection {
    /// A connection over `stream`, with nothing read yet.
    pub fn new(stream: EngineStream) -> Self {
        EngineConnection { stream, read: BytesMut::new(), body: None, keepalive: false, write: BytesMut::new() }
    }

    /// The buffer to put the next request's head in, empty ([`Self::send`] sends it).
    pub fn request_head_buffer(&mut self) -> &mut BytesMut {
        self.write.clear();
        &mut self.write
    }

    /// Write the whole request (the head put in [`Self::request_head_buffer`], then `body`)
    /// within `limit`: one write, unless the body is large (then copying it behind the head
    /// would cost more than a second write).
    pub async fn send(&mut self, body: &Bytes, limit: Duration) -> Result<(), EngineIoError> {
        const JOIN_BELOW: usize = 64 * 1024;
        let (stream, head) = (&mut self.stream, &mut self.write);
        let write = async {
            if body.len() < JOIN_BELOW {
                head.extend_from_slice(body);
                stream.write_all(head).await?;
            } else {
                stream.write_all(head).await?;
                stream.write_all(body).await?;
            }
            stream.flush().await
        };
        let written = match crate::deadline::within(limit, write).await {
            Ok(r) => r.map_err(EngineIoError::Io),
            Err(_) => Err(EngineIoError::WriteTimeout),
        };
        crate::http::recycle_write_buffer(&mut self.write);
        written
    }

    /// Read the response head within `limit` (interim 1xx responses skipped).
    pub async fn read_head(&mut self, limit: Duration) -> Result<ResponseHead, EngineIoError> {
        let read = async {
            loop {
                if !self.read.is_empty() {
                    if let Some(head) = head::parse_response_head(&mut self.read)? {
                        if (100..200).contains(&head.status) {
                            continue;
                        }
                        return Ok(head);
                    }
                }
                if self.fill().await? == 0 {
                    return Err(EngineIoError::Closed(0));
                }
            }
        };
        let head = match timeout(limit, read).await {
            Ok(r) => r?,
            Err(_) => return Err(EngineIoError::ReadTimeout),
        };
        self.keepalive = head.keepalive;
        self.body = Some(BodyDecoder::new(head.framing));
        Ok(head)
    }

    /// Move the body bytes already read into `out`, without waiting.
    pub fn take_buffered(&mut self, out: &mut BytesMut) -> Result<Progress, EngineIoError> {
        let body = self.body.as_mut().expect("the head was read");
        Ok(body.decode(&mut self.read, out)?)
    }

    /// Wait until some body bytes (or the body's end) arrive, and move every body byte read
    /// into `out`. Cancel-safe: what was read stays buffered.
    pub async fn read_body(&mut self, out: &mut BytesMut) -> Result<Progress, EngineIoError> {
        loop {
            let before = out.len();
            let progress = self.take_buffered(out)?;
            if progress == Progress::Ended || out.len() > before {
                return Ok(progress);
            }
            if self.fill().await? == 0 {
                let body = self.body.as_mut().expect("the head was read");
                body.eof()?;
                self.keepalive = false;
                return Ok(Progress::Ended);
            }
        }
    }

    /// Whether the response body has been read to its end.
    pub fn is_body_done(&self) -> bool {
        self.body.as_ref().is_some_and(|b| b.is_done())
    }

    /// The connection, for the next request, with its read buffer (one allocation per
    /// connection, not per request): only after a whole response on a connection the engine
    /// keeps, with nothing unexpected read past the response.
    pub fn into_reusable(mut self) -> Option<EngineConnection> {
        if !(self.keepalive && self.is_body_done() && self.read.is_empty()) {
            return None;
        }
        (self.body, self.keepalive) = (None, false);
        Some(self)
    }

    /// One read from the engine into the buffer; 0 at end of stream.
    async fn fill(&mut self) -> std::io::Result<usize> {
        crate::http::make_read_room(&mut self.read, READ_BYTES);
        self.stream.read_buf(&mut self.read).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    /// Requests sent one after another on one connection arrive whole and alone: the reused
    /// request buffer starts empty each time, and one grown past
    /// [`crate::http::KEEP_WRITE_BYTES`] is let go.
    #[tokio::test]
    async fn each_request_leaves_whole_from_a_buffer_reused_or_let_go() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let mut up = EngineConnection::new(EngineStream::Tcp(client.unwrap()));
        let mut engine = server.unwrap().0;
        let limit = Duration::from_secs(5);
        for (head, body) in
            [("POST /a\r\n\r\n", vec![b'1'; 10]), ("POST /bb\r\n\r\n", vec![b'2'; 20_000]), ("GET /\r\n\r\n", vec![])]
        {
            up.request_head_buffer().extend_from_slice(head.as_bytes());
            up.send(&Bytes::from(body.clone()), limit).await.unwrap();
            let mut got = vec![0; head.len() + body.len()];
            engine.read_exact(&mut got).await.unwrap();
            assert_eq!(got, [head.as_bytes(), &body].concat());
            assert!(up.write.is_empty() && up.write.capacity() <= crate::http::KEEP_WRITE_BYTES);
        }
    }
}
