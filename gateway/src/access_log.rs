//! The access log: one JSON line per request, buffered like NGINX's `access_log … buffer=64k
//! flush=1s`.
//!
//! A line is written from a borrowed struct straight into a shared buffer by
//! [`AccessLine::write_json`] (no per-line allocation; a hand-written writer costs a quarter
//! of what serde's did per line, which the gateway pays on every request) and the buffer is
//! written out when it passes
//! [`BUFFER_BYTES`] or when [`AccessLog::flush`] runs (every second from the reloader, and
//! at shutdown). Lines are never split: the buffer only ever holds whole lines.

use parking_lot::Mutex;
use std::io::Write;

/// Buffer size that triggers a write.
pub const BUFFER_BYTES: usize = 64 * 1024;

/// One request.
#[derive(Debug)]
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
    /// The API key's tenant (never the key); left out when none.
    pub tenant: Option<&'a str>,
    /// Error kind.
    pub error: Option<&'a str>,
    /// `X-Request-Id` of a completion (the client's or the gateway's); left out when none.
    pub request_id: Option<&'a str>,
}

impl AccessLine<'_> {
    /// Append the line as one compact JSON object (no newline). Times are milliseconds with
    /// microsecond precision; an absent optional field is `null`, except `tenant` and
    /// `request_id`, which are left out.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        // Each field's name goes out with the punctuation around it as one literal: half
        // the copies of writing them apart, on a line every request writes.
        let mut ints = itoa::Buffer::new();
        out.reserve(256);
        out.extend_from_slice(b"{\"ts_ms\":");
        out.extend_from_slice(ints.format(self.ts_ms).as_bytes());
        field(out, b",\"method\":", Some(self.method));
        field(out, b",\"path\":", Some(self.path));
        out.extend_from_slice(b",\"status\":");
        out.extend_from_slice(ints.format(self.status).as_bytes());
        field(out, b",\"model\":", self.model);
        field(out, b",\"backend\":", self.backend);
        field(out, b",\"reason\":", self.reason);
        out.extend_from_slice(if self.stream {
            b",\"stream\":true,\"ttft_ms\":"
        } else {
            b",\"stream\":false,\"ttft_ms\":"
        });
        match self.ttft_ms {
            Some(ms) => millis(out, ms),
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b",\"duration_ms\":");
        millis(out, self.duration_ms);
        for (name, n) in [
            (&b",\"request_bytes\":"[..], self.request_bytes),
            (b",\"response_bytes\":", self.response_bytes),
            (b",\"chunks\":", self.chunks),
            (b",\"retries\":", self.retries as usize),
        ] {
            out.extend_from_slice(name);
            out.extend_from_slice(ints.format(n).as_bytes());
        }
        if self.tenant.is_some() {
            field(out, b",\"tenant\":", self.tenant);
        }
        field(out, b",\"error\":", self.error);
        if self.request_id.is_some() {
            field(out, b",\"request_id\":", self.request_id);
        }
        out.push(b'}');
    }
}

/// `,"name":` (given whole, as `prefix`) and the value as a JSON string, or `null`.
fn field(out: &mut Vec<u8>, prefix: &[u8], value: Option<&str>) {
    out.extend_from_slice(prefix);
    match value {
        // Paths, models and ids almost never need escaping: copied as they are then.
        // A fold without early exit: the compiler checks many bytes per instruction.
        Some(v) if !v.bytes().fold(false, |esc, b| esc | (b < 0x20) | (b == b'"') | (b == b'\\')) => {
            out.push(b'"');
            out.extend_from_slice(v.as_bytes());
            out.push(b'"');
        }
        Some(v) => {
            let _ = serde_json::to_writer(&mut *out, v);
        }
        None => out.extend_from_slice(b"null"),
    }
}

/// Milliseconds as a JSON number with three decimals (microseconds).
fn millis(out: &mut Vec<u8>, ms: f64) {
    let micros = if ms.is_finite() && ms > 0.0 { (ms * 1e3).round() as u64 } else { 0 };
    out.extend_from_slice(itoa::Buffer::new().format(micros / 1000).as_bytes());
    let frac = micros % 1000;
    out.extend_from_slice(&[b'.', b'0' + (frac / 100) as u8, b'0' + (frac / 10 % 10) as u8, b'0' + (frac % 10) as u8]);
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
            line.write_json(&mut buf);
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

    #[test]
    fn every_field_is_valid_json_whatever_it_holds() {
        let mut l = line(7);
        let awkward = "/v1/\"quoted\"\\path\n\u{1}ünï";
        l.path = awkward;
        l.model = None;
        l.tenant = Some("team-a");
        l.request_id = Some("r-1");
        l.error = Some("upstream_timeout");
        l.ttft_ms = Some(0.0004);
        l.duration_ms = 1234.5678;
        let mut out = Vec::new();
        l.write_json(&mut out);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["path"], awkward);
        assert_eq!(v["model"], serde_json::Value::Null);
        assert_eq!(v["backend"], serde_json::Value::Null);
        assert_eq!((v["tenant"].as_str(), v["request_id"].as_str()), (Some("team-a"), Some("r-1")));
        assert_eq!(v["ttft_ms"].as_f64(), Some(0.0));
        assert_eq!(v["duration_ms"].as_f64(), Some(1234.568));
        assert_eq!(
            (v["stream"].as_bool(), v["request_bytes"].as_u64(), v["error"].as_str()),
            (Some(true), Some(7), Some("upstream_timeout"))
        );
        // Absent tenant and id are left out, not null.
        let mut out = Vec::new();
        line(1).write_json(&mut out);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert!(v.get("tenant").is_none() && v.get("request_id").is_none(), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 15);
    }
}
