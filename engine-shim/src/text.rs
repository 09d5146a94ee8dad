//! Parser for the Prometheus text exposition format, version 0.0.4.
//!
//! The format is line oriented. Lines end in `\n` (a `\r` before it is
//! dropped, so `\r\n` bodies work). Leading and trailing blanks (space, tab)
//! are ignored. Each line is one of:
//!
//! * empty or blank: skipped;
//! * a comment, i.e. its first non-blank character is `#`: skipped. This
//!   covers `# HELP`, `# TYPE` and free-form comments alike; the shim needs
//!   neither docstrings nor types, because histogram and summary series
//!   (`_bucket`, `_sum`, `_count`, quantiles) are ordinary samples here;
//! * a sample:
//!
//! ```text
//! sample    = name [blanks] [ "{" labels "}" ] blanks value [ blanks timestamp ] [blanks]
//! name      = [a-zA-Z_:] [a-zA-Z0-9_:]*
//! labels    = [blanks] [ label { [blanks] "," [blanks] label } [ [blanks] "," ] ] [blanks]
//! label     = label_name [blanks] "=" [blanks] '"' escaped '"'
//! label_name= [a-zA-Z_] [a-zA-Z0-9_]*
//! escaped   = any UTF-8 except '"', '\' and newline, or one of \\ \" \n
//! value     = float: decimal or scientific, NaN, +Inf, -Inf (case-insensitive)
//! timestamp = signed 64-bit integer, milliseconds since the epoch
//! ```
//!
//! As in Prometheus' own parser, the blank between a closing `}` and the value
//! may be omitted, a trailing comma in the label set is allowed, and a label
//! name may appear at most once per sample. Timestamps are validated and then
//! dropped: a scraper stamps the scrape itself.
//!
//! The parser works on bytes for structure and only ever slices the line at
//! ASCII delimiters, so it cannot split a UTF-8 character; label values are
//! borrowed from the input unless they contain escapes. The first malformed
//! line aborts the parse with [`ShimError::Syntax`] naming that line.

use std::borrow::Cow;

use crate::ShimError;

/// One sample (one line) of the exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name, e.g. `vllm:num_requests_running` or `tgi_request_duration_bucket`.
    pub name: String,
    /// Label pairs in the order they appear, with escapes resolved.
    pub labels: Vec<(String, String)>,
    /// Sample value; may be NaN or infinite.
    pub value: f64,
}

impl Sample {
    /// Value of the label `name`, if the sample carries it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// Parse a whole exposition body into its samples, in order.
///
/// Comments, `# HELP`/`# TYPE` lines and blank lines produce no sample.
/// The first malformed line yields [`ShimError::Syntax`] with its 1-based
/// line number.
pub fn parse_samples(text: &str) -> Result<Vec<Sample>, ShimError> {
    let mut out = Vec::new();
    for_each_sample(text, |s| {
        out.push(Sample {
            name: s.name.to_owned(),
            labels: s.labels.iter().map(|(n, v)| ((*n).to_owned(), v.clone().into_owned())).collect(),
            value: s.value,
        });
    })?;
    Ok(out)
}

/// A sample borrowed from the input; the label slice is only valid for the
/// duration of one callback.
pub(crate) struct SampleRef<'a, 'b> {
    pub(crate) name: &'a str,
    pub(crate) labels: &'b [(&'a str, Cow<'a, str>)],
    pub(crate) value: f64,
}

impl SampleRef<'_, '_> {
    /// Value of the label `name`, if the sample carries it.
    pub(crate) fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_ref())
    }
}

/// Parse `text` and hand every sample to `f`, without allocating per sample
/// (the label buffer is reused from line to line).
pub(crate) fn for_each_sample<'a>(text: &'a str, mut f: impl FnMut(&SampleRef<'a, '_>)) -> Result<(), ShimError> {
    let mut labels = Vec::new();
    for (index, raw) in text.split('\n').enumerate() {
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        labels.clear();
        match parse_line(line, &mut labels) {
            Ok(Some((name, value))) => f(&SampleRef { name, labels: &labels, value }),
            Ok(None) => {}
            Err(reason) => return Err(ShimError::Syntax { line: index + 1, reason }),
        }
    }
    Ok(())
}

/// Parse one line (without its line ending). `Ok(None)` for blank lines and
/// comments; otherwise the name and value, with the labels pushed to `labels`.
fn parse_line<'a>(line: &'a str, labels: &mut Vec<(&'a str, Cow<'a, str>)>) -> Result<Option<(&'a str, f64)>, String> {
    let mut c = Cursor { s: line, pos: 0 };
    c.skip_blanks();
    match c.peek() {
        None | Some(b'#') => return Ok(None),
        Some(_) => {}
    }

    let name = c.take_while(is_name_byte);
    if name.is_empty() {
        return Err(format!("expected a metric name, found {}", c.found()));
    }
    if name.as_bytes()[0].is_ascii_digit() {
        return Err(format!("metric name `{}` starts with a digit", clip(name)));
    }

    let blank_after_name = c.skip_blanks();
    if c.eat(b'{') {
        parse_labels(&mut c, name, labels)?;
        c.skip_blanks();
    } else if !blank_after_name && c.peek().is_some() {
        return Err(format!("invalid character {} in metric name `{}`", c.found(), clip(name)));
    }

    let token = c.take_while(|b| !is_blank(b));
    if token.is_empty() {
        return Err(format!("missing value for metric `{}`", clip(name)));
    }
    let value =
        parse_value(token).ok_or_else(|| format!("invalid value `{}` for metric `{}`", clip(token), clip(name)))?;

    if c.skip_blanks() && c.peek().is_some() {
        let ts = c.take_while(|b| !is_blank(b));
        if ts.parse::<i64>().is_err() {
            return Err(format!(
                "invalid timestamp `{}` for metric `{}` (expected integer milliseconds)",
                clip(ts),
                clip(name)
            ));
        }
        c.skip_blanks();
    }
    if c.peek().is_some() {
        return Err(format!("unexpected text `{}` after the sample of `{}`", clip(c.rest()), clip(name)));
    }
    Ok(Some((name, value)))
}

/// Parse a label set; the cursor is just past `{` and ends just past `}`.
fn parse_labels<'a>(c: &mut Cursor<'a>, metric: &str, labels: &mut Vec<(&'a str, Cow<'a, str>)>) -> Result<(), String> {
    loop {
        c.skip_blanks();
        // `}` here closes an empty set, or follows a trailing comma.
        if c.eat(b'}') {
            return Ok(());
        }
        let name = c.take_while(is_label_name_byte);
        if name.is_empty() {
            return Err(match c.peek() {
                None => format!("unterminated label set of `{}` (missing `}}`)", clip(metric)),
                Some(_) => {
                    format!("expected a label name or `}}` in the labels of `{}`, found {}", clip(metric), c.found())
                }
            });
        }
        if name.as_bytes()[0].is_ascii_digit() {
            return Err(format!("label name `{}` of `{}` starts with a digit", clip(name), clip(metric)));
        }
        c.skip_blanks();
        if !c.eat(b'=') {
            return Err(format!("expected `=` after label name `{}`, found {}", clip(name), c.found()));
        }
        c.skip_blanks();
        if !c.eat(b'"') {
            return Err(format!("expected `\"` to open the value of label `{}`, found {}", clip(name), c.found()));
        }
        let value = parse_label_value(c, name)?;
        if labels.iter().any(|(n, _)| *n == name) {
            return Err(format!("duplicate label `{}` on `{}`", clip(name), clip(metric)));
        }
        labels.push((name, value));
        c.skip_blanks();
        if c.eat(b',') {
            continue;
        }
        if c.eat(b'}') {
            return Ok(());
        }
        return Err(match c.peek() {
            None => format!("unterminated label set of `{}` (missing `}}`)", clip(metric)),
            Some(_) => format!("expected `,` or `}}` after the value of label `{}`, found {}", clip(name), c.found()),
        });
    }
}

/// Parse a label value; the cursor is just past the opening `"` and ends
/// just past the closing one. Borrows unless an escape must be resolved.
fn parse_label_value<'a>(c: &mut Cursor<'a>, label: &str) -> Result<Cow<'a, str>, String> {
    let s = c.s;
    let bytes = s.as_bytes();
    let start = c.pos;
    let mut owned: Option<String> = None;
    let mut segment = start;
    let mut i = start;
    loop {
        match bytes.get(i) {
            None => return Err(format!("unterminated value of label `{}` (missing closing `\"`)", clip(label))),
            Some(b'"') => {
                c.pos = i + 1;
                return Ok(match owned {
                    None => Cow::Borrowed(&s[start..i]),
                    Some(mut buf) => {
                        buf.push_str(&s[segment..i]);
                        Cow::Owned(buf)
                    }
                });
            }
            Some(b'\\') => {
                let unescaped = match bytes.get(i + 1) {
                    Some(b'\\') => '\\',
                    Some(b'"') => '"',
                    Some(b'n') => '\n',
                    None => {
                        return Err(format!("unterminated value of label `{}` (line ends in `\\`)", clip(label)));
                    }
                    Some(_) => {
                        let mut seq = String::from("\\");
                        push_printable(&mut seq, s[i + 1..].chars().next().unwrap_or('?'));
                        return Err(format!(
                            "invalid escape sequence `{seq}` in the value of label `{}` (only \\\\, \\\" and \\n are allowed)",
                            clip(label)
                        ));
                    }
                };
                let buf = owned.get_or_insert_with(String::new);
                buf.push_str(&s[segment..i]);
                buf.push(unescaped);
                i += 2;
                segment = i;
            }
            Some(_) => i += 1,
        }
    }
}

/// Parse a sample value the way Go's `strconv.ParseFloat` does for the
/// spellings exporters emit: decimal, scientific, `NaN`, `+Inf`, `-Inf`,
/// `Inf` (any case).
fn parse_value(token: &str) -> Option<f64> {
    token.parse::<f64>().ok()
}

fn is_blank(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

fn is_label_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// At most 48 characters of `s`, control characters escaped, for error
/// messages about untrusted input.
fn clip(s: &str) -> String {
    const MAX: usize = 48;
    let mut out = String::with_capacity(s.len().min(MAX + 8));
    for (i, ch) in s.chars().enumerate() {
        if i == MAX {
            out.push('…');
            break;
        }
        push_printable(&mut out, ch);
    }
    out
}

/// `ch`, or its escape if it is a control character.
fn push_printable(out: &mut String, ch: char) {
    if ch.is_control() {
        out.extend(ch.escape_debug());
    } else {
        out.push(ch);
    }
}

/// A position in one line. `pos` only ever moves past ASCII bytes or to the
/// end of a run that stops at an ASCII byte, so it is always a char boundary.
struct Cursor<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.pos).copied()
    }

    /// Consume `b` if it is next.
    fn eat(&mut self, b: u8) -> bool {
        let hit = self.peek() == Some(b);
        if hit {
            self.pos += 1;
        }
        hit
    }

    /// Skip spaces and tabs; whether any were skipped.
    fn skip_blanks(&mut self) -> bool {
        let start = self.pos;
        while self.peek().is_some_and(is_blank) {
            self.pos += 1;
        }
        self.pos > start
    }

    /// Consume the longest run of bytes matching `pred` (which must reject
    /// either all non-ASCII bytes or no byte of a multi-byte character).
    fn take_while(&mut self, pred: impl Fn(u8) -> bool) -> &'a str {
        let start = self.pos;
        while self.peek().is_some_and(&pred) {
            self.pos += 1;
        }
        &self.s[start..self.pos]
    }

    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }

    /// The next character, quoted, or "end of line", for error messages.
    fn found(&self) -> String {
        match self.rest().chars().next() {
            None => "end of line".to_owned(),
            Some(ch) => {
                let mut out = String::from("`");
                push_printable(&mut out, ch);
                out.push('`');
                out
            }
        }
    }
}

#[cfg(test)]
mod tests;
