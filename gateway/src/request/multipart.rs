//! The routing fields of a `multipart/form-data` body (`/v1/audio/transcriptions`,
//! `/v1/audio/translations`, …): the `model` and `stream` form fields, read without copying
//! the body, which is forwarded as it came.
//!
//! RFC 7578 over RFC 2046: the body is parts separated by `--BOUNDARY` lines, the last one
//! followed by `--`; each part has headers (here only `Content-Disposition: form-data;
//! name="…"` matters, parsed with `httparse`), a blank line, then its bytes up to the CRLF
//! before the next delimiter. Anything that does not follow that shape is a 400 naming what
//! is wrong.

use memchr::memmem;

/// The longest text form field read (`model`, `stream`); a file part is skipped whatever its
/// size.
const MAX_TEXT_FIELD_BYTES: usize = 4096;
/// Headers of one part, at most.
const MAX_PART_HEADERS: usize = 16;

/// The `boundary` parameter of a `multipart/form-data` content type; `None` for any other
/// type. `Err` for a multipart type without a usable boundary.
pub fn form_data_boundary(content_type: &str) -> Option<Result<&str, String>> {
    let mut params = content_type.split(';');
    let media = params.next().unwrap_or_default().trim();
    if !media.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    let mut boundaries = params.filter_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim().eq_ignore_ascii_case("boundary").then(|| v.trim().trim_matches('"'))
    });
    let boundary = boundaries.next();
    // Parsers disagree on which of two to take (python-multipart, vLLM's, takes the last).
    if boundaries.next().is_some() {
        return Some(Err("multipart/form-data with more than one boundary parameter".into()));
    }
    Some(match boundary {
        // RFC 2046: 1 to 70 characters.
        Some(b) if !b.is_empty() && b.len() <= 70 => Ok(b),
        Some(b) => Err(format!("multipart boundary must be 1 to 70 characters, got {}", b.len())),
        None => Err("multipart/form-data without a boundary parameter".into()),
    })
}

/// The text form fields `wanted` names, in that order (`None` where absent), from a
/// `multipart/form-data` body with `boundary`.
pub fn text_fields<'b, const N: usize>(
    body: &'b [u8],
    boundary: &str,
    wanted: [&str; N],
) -> Result<[Option<&'b str>; N], String> {
    let mut found = [None; N];
    let delimiter = format!("\r\n--{boundary}");
    let finder = memmem::Finder::new(delimiter.as_bytes());
    // The body opens with the first delimiter, or a preamble ends with it.
    let mut at = if body.starts_with(&delimiter.as_bytes()[2..]) && is_delimiter_end(&body[delimiter.len() - 2..]) {
        delimiter.len() - 2
    } else {
        next_delimiter(&finder, body, 0, delimiter.len())
            .ok_or("multipart body has no part (its boundary never appears)")?
            + delimiter.len()
    };
    loop {
        let rest = &body[at..];
        if rest.starts_with(b"--") {
            return Ok(found);
        }
        let padding = rest.iter().take_while(|b| matches!(b, b' ' | b'\t')).count();
        if !rest[padding..].starts_with(b"\r\n") {
            return Err("multipart delimiter not followed by CRLF".into());
        }
        let start = at + padding + 2;
        // The part runs to the CRLF of the next delimiter.
        let end = next_delimiter(&finder, body, start, delimiter.len())
            .ok_or("multipart body ends without its closing delimiter")?;
        let (name, value) = part_field(&body[start..end])?;
        if let Some(i) = wanted.iter().position(|w| name == Some(*w)) {
            if found[i].is_some() {
                return Err(format!("multipart form field {:?} is given twice", wanted[i]));
            }
            if value.len() > MAX_TEXT_FIELD_BYTES {
                return Err(format!("multipart form field {:?} is over {MAX_TEXT_FIELD_BYTES} bytes", wanted[i]));
            }
            let text =
                std::str::from_utf8(value).map_err(|_| format!("multipart form field {:?} is not UTF-8", wanted[i]))?;
            found[i] = Some(text);
        }
        at = end + delimiter.len();
    }
}

/// Where the next delimiter (`CRLF--boundary` followed by `--`, or by optional padding and
/// CRLF) starts at or after `from`; a near miss (`--boundary-more` in a file's bytes) is
/// content.
fn next_delimiter(finder: &memmem::Finder<'_>, body: &[u8], from: usize, len: usize) -> Option<usize> {
    let mut at = from;
    loop {
        let pos = at + finder.find(&body[at..])?;
        if is_delimiter_end(&body[pos + len..]) {
            return Some(pos);
        }
        at = pos + 1;
    }
}

/// Whether what follows a boundary makes it a delimiter: `--` (the last), or transport
/// padding and CRLF; also the body's end (then the caller reports what is missing).
fn is_delimiter_end(after: &[u8]) -> bool {
    let padding = after.iter().take_while(|b| matches!(b, b' ' | b'\t')).count();
    after.starts_with(b"--") || after[padding..].starts_with(b"\r\n") || after[padding..].is_empty()
}

/// A part's form field name (from `Content-Disposition`) and its bytes.
fn part_field(part: &[u8]) -> Result<(Option<&str>, &[u8]), String> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_PART_HEADERS];
    let (len, headers) = match httparse::parse_headers(part, &mut headers) {
        Ok(httparse::Status::Complete((len, headers))) => (len, headers),
        Ok(httparse::Status::Partial) => return Err("multipart part headers do not end".into()),
        Err(e) => return Err(format!("multipart part headers: {e}")),
    };
    let mut dispositions = headers.iter().filter(|h| h.name.eq_ignore_ascii_case("content-disposition"));
    let disposition = dispositions.next();
    // Parsers disagree on which of two to read: refused, as a strict parser should.
    if dispositions.next().is_some() {
        return Err("multipart part with more than one Content-Disposition".into());
    }
    let name = match disposition {
        None => None,
        Some(h) => {
            let v = std::str::from_utf8(h.value).map_err(|_| "multipart Content-Disposition is not UTF-8")?;
            disposition_name(v)?
        }
    };
    Ok((name, &part[len..]))
}

/// `name` of `form-data; name="model"` (quoted or not); two `name` parameters are refused
/// (python-multipart takes the last, a first-wins reader the first).
fn disposition_name(v: &str) -> Result<Option<&str>, String> {
    let mut params = v.split(';');
    if !params.next().unwrap_or_default().trim().eq_ignore_ascii_case("form-data") {
        return Ok(None);
    }
    let mut names = params.filter_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim().eq_ignore_ascii_case("name").then(|| v.trim().trim_matches('"'))
    });
    let name = names.next();
    if names.next().is_some() {
        return Err("multipart Content-Disposition with more than one name parameter".into());
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(parts: &[(&str, &str, &[u8])]) -> Vec<u8> {
        let mut b = b"preamble\r\n".to_vec();
        for (name, extra, value) in parts {
            b.extend_from_slice(
                format!("--XyZ\r\nContent-Disposition: form-data; name=\"{name}\"{extra}\r\n\r\n").as_bytes(),
            );
            b.extend_from_slice(value);
            b.extend_from_slice(b"\r\n");
        }
        b.extend_from_slice(b"--XyZ--\r\n");
        b
    }

    #[test]
    fn parameters_that_parsers_read_differently_are_refused() {
        let twice = form_data_boundary("multipart/form-data; boundary=AAA; boundary=BBB").unwrap();
        assert!(twice.unwrap_err().contains("more than one boundary"));
        let named_twice = b"--XyZ\r\nContent-Disposition: form-data; name=\"x\"; name=\"model\"\r\n\r\nm\r\n--XyZ--";
        assert!(text_fields(named_twice, "XyZ", ["model"]).unwrap_err().contains("more than one name"));
        let two_dispositions = b"--XyZ\r\nContent-Disposition: form-data; name=\"x\"\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--XyZ--";
        assert!(text_fields(two_dispositions, "XyZ", ["model"])
            .unwrap_err()
            .contains("more than one Content-Disposition"));
    }

    #[test]
    fn the_boundary_comes_from_the_content_type() {
        assert_eq!(form_data_boundary("multipart/form-data; boundary=XyZ"), Some(Ok("XyZ")));
        assert_eq!(form_data_boundary("Multipart/Form-Data; charset=utf-8; Boundary=\"a b\""), Some(Ok("a b")));
        assert_eq!(form_data_boundary("application/json"), None);
        assert!(form_data_boundary("multipart/form-data").unwrap().is_err());
        assert!(form_data_boundary(&format!("multipart/form-data; boundary={}", "x".repeat(71))).unwrap().is_err());
    }

    #[test]
    fn text_fields_are_found_around_a_file_part() {
        // A file part whose bytes hold CRLFs and a near-delimiter.
        let audio: &[u8] = b"RIFF\r\n--XyZ-not-quite\x00\xff\r\n";
        let body = form(&[
            ("file", "; filename=\"a.wav\"\r\nContent-Type: audio/wav", audio),
            ("model", "", b"whisper-large-v3"),
            ("stream", "", b"true"),
        ]);
        let [model, stream, missing] = text_fields(&body, "XyZ", ["model", "stream", "language"]).unwrap();
        assert_eq!((model, stream, missing), (Some("whisper-large-v3"), Some("true"), None));
    }

    #[test]
    fn broken_bodies_are_refused_with_the_reason() {
        let twice = form(&[("model", "", b"a"), ("model", "", b"b")]);
        let long = form(&[("model", "", &[b'm'; 5000])]);
        let binary = form(&[("model", "", b"\xff\xfe")]);
        for (body, says) in [
            (b"no delimiter at all".to_vec(), "boundary never appears"),
            (b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm".to_vec(), "closing delimiter"),
            // Not a delimiter (it goes on after the boundary), so there is none.
            (b"--XyZ junk".to_vec(), "never appears"),
            (b"--XyZ\r\n\r\nfirst\r\n--XyZ junk".to_vec(), "closing delimiter"),
            (b"--XyZ\r\nno colon here\r\n\r\nm\r\n--XyZ--".to_vec(), "headers"),
            (twice, "twice"),
            (long, "over 4096"),
            (binary, "UTF-8"),
        ] {
            let err = text_fields(&body, "XyZ", ["model"]).unwrap_err();
            assert!(err.contains(says), "{err}");
        }
    }
}
