//! The access log: one JSON line per request, buffered like NGINX's `access_log … buffer=64k
//! flush=1s`.
//!
//! A line is serialized from a borrowed struct straight into a shared buffer (no per-line
//! allocation, no formatter machinery) and the buffer is written out when it passes
//! [`BUFFER_BYTES`] or when [`AccessLog::flush`] runs (every second from the reloader, and
//! at shutdown). Lines are never split: the buffer only ever holds whole lines.

use parking_lot::Mutex;
use std::io::Write;

use serde::Serialize;

/// Buffer size that triggers a write.
pub const BUFFER_BYTES: usize = 64 * 1024;

/// One request.
#[derive(Debug, Serialize)]
pub struct AccessLine<'a> {
    /// Unix time in ms at the end of the request.
    pub ts_ms: u64,
    /// Method.
    pub method: &'a str,
    /// Path.
    pub path: &'a str,
    /// Status (499: the client left).
    pub status: u16,
    /// Requested model.
    pub model: Option<&'a str>,
    /// Backend URL.
    pub backend: Option<&'a str>,
    /// Routing reason.
    pub reason: Option<&'a str>,
    /// Streamed?
    pub stream: bool,
    /// Arrival → first response chunk.
    pub ttft_ms: Option<f64>,
    /// Arrival → end.
    pub duration_ms: f64,
    /// Request body bytes.
    pub request_bytes: usize,
    /// Response body bytes.
    pub response_bytes: usize,
    /// Response chunks streamed.
    pub chunks: usize,
    /// Retries on other backends.
    pub retries: u32,
    /// The API key's tenant (never the key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<&'a str>,
    /// Error kind.
    pub error: Option<&'a str>,
    /// `X-Request-Id` of a completion (the client's or the gateway's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<&'a str>,
}

/// Buffered JSON-lines sink.
pub struct AccessLog {
    buf: Mutex<Vec<u8>>,
    out: Mutex<Box<dyn Write + Send>>,
}

impl AccessLog {
    /// A log writing to `out`.
    pub fn new(out: Box<dyn Write + Send>) -> Self {
        AccessLog { buf: Mutex::new(Vec::with_capacity(BUFFER_BYTES * 2)), out: Mutex::new(out) }
    }

    /// A log writing to stdout.
    pub fn stdout() -> Self {
        Self::new(Box::new(std::io::stdout()))
    }

    /// Append one line; writes the buffer out when it is full.
    pub fn log(&self, line: &AccessLine<'_>) {
        let full = {
            let mut buf = self.buf.lock();
            if serde_json::to_writer(&mut *buf, line).is_err() {
                return;
            }
            buf.push(b'\n');
            (buf.len() >= BUFFER_BYTES).then(|| std::mem::replace(&mut *buf, Vec::with_capacity(BUFFER_BYTES * 2)))
        };
        if let Some(bytes) = full {
            self.write(&bytes);
        }
    }

    /// Write out whatever is buffered.
    pub fn flush(&self) {
        let bytes = std::mem::take(&mut *self.buf.lock());
        if !bytes.is_empty() {
            self.write(&bytes);
        }
    }

    fn write(&self, bytes: &[u8]) {
        let mut out = self.out.lock();
        let _ = out.write_all(bytes);
        let _ = out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn line(i: usize) -> AccessLine<'static> {
        AccessLine {
            ts_ms: 1,
            method: "POST",
            path: "/v1/completions",
            status: 200,
            model: Some("m"),
            backend: None,
            reason: None,
            stream: true,
            ttft_ms: Some(1.5),
            duration_ms: 2.0,
            request_bytes: i,
            response_bytes: 0,
            chunks: 0,
            retries: 0,
            tenant: None,
            error: None,
            request_id: None,
        }
    }

    #[test]
    fn buffers_whole_lines_and_flushes_them() {
        let out = Shared::default();
        let log = AccessLog::new(Box::new(out.clone()));
        log.log(&line(1));
        assert!(out.0.lock().is_empty(), "buffered");
        for i in 0..2000 {
            log.log(&line(i));
        }
        let written = out.0.lock().len();
        assert!(written >= BUFFER_BYTES, "a full buffer is written");
        log.flush();
        let text = String::from_utf8(out.0.lock().clone()).unwrap();
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(lines.len(), 2001);
        for l in lines {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["status"], 200);
        }
    }
}
