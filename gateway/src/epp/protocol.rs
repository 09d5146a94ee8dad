//! The Endpoint Picker protocol's messages, pure: reading what Envoy sends (the request
//! head, the subset hint, the endpoint that served) and building what the picker answers.
//!
//! Facts from GIE's protocol (docs/proposals/004-endpoint-picker-protocol): the picked
//! endpoints go in a request header and, with the same value, in the dynamic metadata
//! namespace `envoy.lb`; the gateway may restrict the pick with a list under
//! `envoy.lb.subset_hint`; it reports the endpoint that served under `envoy.lb` in the
//! response phase's metadata. Bodies are echoed in `StreamedBodyResponse` chunks (the
//! `FULL_DUPLEX_STREAMED` body mode), each at most [`MAX_CHUNK`] bytes.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse,
    ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use pingora::http::RequestHeader;

/// Largest body chunk echoed in one message (GIE's reference picker uses the same: under
/// Envoy's 64 KiB gRPC frame with room for the envelope).
pub const MAX_CHUNK: usize = 62_000;
/// The metadata namespace of the picked and served endpoints.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset hint's key: the endpoints the pick must come from.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The key (metadata, or a response header) naming the endpoint that served.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

/// A header's value: `raw_value` when Envoy sent one (its default), else `value`.
pub fn header_value(h: &HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

/// The value of header `name` (lower case) in `map`.
pub fn find_header<'a>(map: Option<&'a HeaderMap>, name: &str) -> Option<&'a [u8]> {
    map?.headers.iter().find(|h| h.key.eq_ignore_ascii_case(name)).map(header_value)
}

/// The request head Envoy saw: `:method` and `:path` from its pseudo-headers, the other
/// headers as sent.
///
/// # Errors
/// A message naming what is missing or malformed.
pub fn request_head(map: Option<&HeaderMap>) -> Result<RequestHeader, String> {
    let method = find_header(map, ":method").ok_or("the request headers have no :method")?;
    let path = find_header(map, ":path").ok_or("the request headers have no :path")?;
    let method = std::str::from_utf8(method).map_err(|_| "the :method is not text")?;
    let mut head = RequestHeader::build(method, path, None).map_err(|e| format!("bad :method or :path: {e}"))?;
    for h in map.map_or(&[][..], |m| &m.headers) {
        if h.key.starts_with(':') {
            continue;
        }
        head.append_header(h.key.to_ascii_lowercase(), header_value(h))
            .map_err(|e| format!("bad header {}: {e}", h.key))?;
    }
    Ok(head)
}

/// The response's `:status`.
pub fn response_status(map: Option<&HeaderMap>) -> Option<u16> {
    std::str::from_utf8(find_header(map, ":status")?).ok()?.parse().ok()
}

/// The `ip:port` strings of a metadata value: a string (comma-separated allowed) or a list
/// of strings.
fn endpoints_of(value: &Value) -> Vec<String> {
    match &value.kind {
        Some(Kind::StringValue(s)) => s.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect(),
        Some(Kind::ListValue(list)) => list.values.iter().flat_map(endpoints_of).collect(),
        _ => Vec::new(),
    }
}

/// The endpoints the gateway allows this request to go to (`None`: no hint, any endpoint
/// of the pool; `Some(empty)`: none).
pub fn subset_hint(meta: Option<&Metadata>) -> Option<Vec<String>> {
    let value = meta?.filter_metadata.get(SUBSET_NAMESPACE)?.fields.get(SUBSET_KEY)?;
    Some(endpoints_of(value))
}

/// The endpoint that served the request: from the response phase's metadata (the
/// protocol's way), else from a response header of the same name (a plain Envoy can add
/// one with `%UPSTREAM_REMOTE_ADDRESS%`).
pub fn served_endpoint(meta: Option<&Metadata>, headers: Option<&HeaderMap>) -> Option<String> {
    let from_meta = meta
        .and_then(|m| m.filter_metadata.get(LB_NAMESPACE))
        .and_then(|s| s.fields.get(SERVED_KEY))
        .and_then(|v| endpoints_of(v).into_iter().next());
    from_meta.or_else(|| {
        let v = std::str::from_utf8(find_header(headers, SERVED_KEY)?).ok()?;
        Some(v.split(',').next()?.trim().to_string()).filter(|s| !s.is_empty())
    })
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.into(), raw_value: value.as_bytes().to_vec(), ..Default::default() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn mutation(set: &[(&str, &str)], remove: &[&str]) -> Option<HeaderMutation> {
    if set.is_empty() && remove.is_empty() {
        return None;
    }
    Some(HeaderMutation {
        set_headers: set.iter().map(|(k, v)| set_header(k, v)).collect(),
        remove_headers: remove.iter().map(|s| s.to_string()).collect(),
    })
}

/// The answer to the request headers once the pick is made: `header` (and the metadata
/// `envoy.lb`) set to `endpoints` (`ip:port[,ip:port…]`, primary first), `set` added,
/// `remove` removed, and the route cache cleared so the gateway routes on the new header.
pub fn route_to(header: &str, endpoints: &str, set: &[(&str, &str)], remove: &[&str]) -> ProcessingResponse {
    let mut all = vec![(header, endpoints)];
    all.extend_from_slice(set);
    let common =
        CommonResponse { header_mutation: mutation(&all, remove), clear_route_cache: true, ..Default::default() };
    let value = Value { kind: Some(Kind::StringValue(endpoints.to_string())) };
    let lb = Struct { fields: [(header.to_string(), value)].into_iter().collect() };
    let lb = Value { kind: Some(Kind::StructValue(lb)) };
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(HeadersResponse { response: Some(common) })),
        dynamic_metadata: Some(Struct { fields: [(LB_NAMESPACE.to_string(), lb)].into_iter().collect() }),
        ..Default::default()
    }
}

fn streamed(body: &[u8], end_of_stream: bool) -> BodyResponse {
    let chunk = StreamedBodyResponse { body: body.to_vec(), end_of_stream, ..Default::default() };
    let mutation = BodyMutation { mutation: Some(body_mutation::Mutation::StreamedResponse(chunk)) };
    BodyResponse { response: Some(CommonResponse { body_mutation: Some(mutation), ..Default::default() }) }
}

/// The request body echoed back in chunks of at most [`MAX_CHUNK`] bytes (one empty chunk
/// for an empty body), the last one marked `end_of_stream` when `end` (no trailers follow).
pub fn request_body(body: &[u8], end: bool) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = if body.is_empty() { vec![body] } else { body.chunks(MAX_CHUNK).collect() };
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| ProcessingResponse {
            response: Some(processing_response::Response::RequestBody(streamed(c, end && i == last))),
            ..Default::default()
        })
        .collect()
}

/// The request trailers, unchanged.
pub fn request_trailers() -> ProcessingResponse {
    let r = processing_response::Response::RequestTrailers(TrailersResponse::default());
    ProcessingResponse { response: Some(r), ..Default::default() }
}

/// The answer to the response headers: `set` added, `remove` removed.
pub fn response_headers(set: &[(&str, &str)], remove: &[&str]) -> ProcessingResponse {
    let common = CommonResponse { header_mutation: mutation(set, remove), ..Default::default() };
    let r = processing_response::Response::ResponseHeaders(HeadersResponse { response: Some(common) });
    ProcessingResponse { response: Some(r), ..Default::default() }
}

/// One response body chunk, passed on unchanged.
pub fn response_body(chunk: &[u8], end_of_stream: bool) -> ProcessingResponse {
    let r = processing_response::Response::ResponseBody(streamed(chunk, end_of_stream));
    ProcessingResponse { response: Some(r), ..Default::default() }
}

/// The response trailers, unchanged.
pub fn response_trailers() -> ProcessingResponse {
    let r = processing_response::Response::ResponseTrailers(TrailersResponse::default());
    ProcessingResponse { response: Some(r), ..Default::default() }
}

/// The picker answers the client itself: `status` with `body` of `content_type`, and the
/// header `fields` (`Retry-After`, the request id…).
pub fn immediate(status: u16, content_type: &str, body: &[u8], fields: &[(&str, &str)]) -> ProcessingResponse {
    let mut set = vec![("content-type", content_type)];
    set.extend_from_slice(fields);
    let reply = ImmediateResponse {
        status: Some(HttpStatus { code: i32::from(status) }),
        headers: mutation(&set, &[]),
        body: body.to_vec(),
        details: "switchyard_epp".into(),
        ..Default::default()
    };
    let r = processing_response::Response::ImmediateResponse(reply);
    ProcessingResponse { response: Some(r), ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: k.to_string(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        }
    }

    fn meta(namespace: &str, key: &str, value: Value) -> Metadata {
        let s = Struct { fields: [(key.to_string(), value)].into_iter().collect() };
        Metadata { filter_metadata: [(namespace.to_string(), s)].into_iter().collect(), ..Default::default() }
    }

    fn string(s: &str) -> Value {
        Value { kind: Some(Kind::StringValue(s.into())) }
    }

    #[test]
    fn the_request_head_comes_from_envoys_pseudo_headers() {
        let map = headers(&[
            (":method", "POST"),
            (":path", "/v1/completions?x=1"),
            (":authority", "gw"),
            ("Authorization", "Bearer k"),
            ("x-a", "1"),
        ]);
        let head = request_head(Some(&map)).unwrap();
        assert_eq!(head.method, "POST");
        assert_eq!(head.uri.path(), "/v1/completions");
        assert_eq!(head.headers.get("authorization").unwrap(), "Bearer k");
        assert!(head.headers.get(":authority").is_none());
        // `value` is read when `raw_value` is empty (older Envoys).
        let old = HeaderMap {
            headers: vec![
                HeaderValue { key: ":method".into(), value: "GET".into(), ..Default::default() },
                HeaderValue { key: ":path".into(), value: "/v1/models".into(), ..Default::default() },
            ],
        };
        assert_eq!(request_head(Some(&old)).unwrap().method, "GET");
        for bad in
            [headers(&[(":path", "/")]), headers(&[(":method", "GET")]), headers(&[(":method", "G T"), (":path", "/")])]
        {
            assert!(request_head(Some(&bad)).is_err(), "{bad:?}");
        }
        assert!(request_head(None).is_err());
        let nul = headers(&[(":method", "GET"), (":path", "/"), ("x", "a\nb")]);
        assert!(request_head(Some(&nul)).is_err());
    }

    #[test]
    fn the_subset_hint_and_the_served_endpoint_are_read_in_every_shape() {
        assert_eq!(subset_hint(None), None);
        let list = Value {
            kind: Some(Kind::ListValue(ListValue { values: vec![string("10.0.0.1:8000"), string("10.0.0.2:8000")] })),
        };
        let m = meta(SUBSET_NAMESPACE, SUBSET_KEY, list);
        assert_eq!(subset_hint(Some(&m)).unwrap(), ["10.0.0.1:8000", "10.0.0.2:8000"]);
        let m = meta(SUBSET_NAMESPACE, SUBSET_KEY, string("10.0.0.1:8000, 10.0.0.3:8000"));
        assert_eq!(subset_hint(Some(&m)).unwrap(), ["10.0.0.1:8000", "10.0.0.3:8000"]);
        let m = meta(SUBSET_NAMESPACE, SUBSET_KEY, Value { kind: Some(Kind::ListValue(ListValue::default())) });
        assert_eq!(subset_hint(Some(&m)), Some(vec![]), "an empty hint allows nothing");

        let m = meta(LB_NAMESPACE, SERVED_KEY, string("10.0.0.2:8000"));
        assert_eq!(served_endpoint(Some(&m), None).as_deref(), Some("10.0.0.2:8000"));
        let h = headers(&[(":status", "200"), (SERVED_KEY, "127.0.0.1:9")]);
        assert_eq!(served_endpoint(None, Some(&h)).as_deref(), Some("127.0.0.1:9"));
        assert_eq!(served_endpoint(Some(&m), Some(&h)).as_deref(), Some("10.0.0.2:8000"), "metadata first");
        assert_eq!(served_endpoint(None, None), None);
        assert_eq!(response_status(Some(&h)), Some(200));
    }

    #[test]
    fn the_pick_goes_in_the_header_and_the_metadata_alike() {
        let r = route_to(
            "x-gateway-destination-endpoint",
            "10.0.0.1:8000,10.0.0.2:8000",
            &[("x-request-id", "r")],
            &["cookie"],
        );
        let Some(processing_response::Response::RequestHeaders(h)) = &r.response else { panic!("{r:?}") };
        let common = h.response.as_ref().unwrap();
        assert!(common.clear_route_cache);
        let m = common.header_mutation.as_ref().unwrap();
        let dest = m.set_headers[0].header.as_ref().unwrap();
        assert_eq!(dest.key, "x-gateway-destination-endpoint");
        assert_eq!(dest.raw_value, b"10.0.0.1:8000,10.0.0.2:8000");
        assert_eq!(m.set_headers[0].append_action, HeaderAppendAction::OverwriteIfExistsOrAdd as i32);
        assert_eq!(m.remove_headers, ["cookie"]);
        let lb = &r.dynamic_metadata.as_ref().unwrap().fields[LB_NAMESPACE];
        let Some(Kind::StructValue(lb)) = &lb.kind else { panic!() };
        assert_eq!(lb.fields["x-gateway-destination-endpoint"], string("10.0.0.1:8000,10.0.0.2:8000"));
    }

    #[test]
    fn bodies_are_echoed_in_bounded_chunks_ending_once() {
        let body: Vec<u8> = (0..150_000u32).map(|i| i as u8).collect();
        let parts = request_body(&body, true);
        assert_eq!(parts.len(), 3);
        let mut echoed = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            let Some(processing_response::Response::RequestBody(b)) = &p.response else { panic!() };
            let m = b.response.as_ref().unwrap().body_mutation.as_ref().unwrap();
            let Some(body_mutation::Mutation::StreamedResponse(s)) = &m.mutation else { panic!() };
            assert!(s.body.len() <= MAX_CHUNK);
            assert_eq!(s.end_of_stream, i == 2);
            echoed.extend_from_slice(&s.body);
        }
        assert_eq!(echoed, body);
        assert_eq!(request_body(b"", true).len(), 1, "an empty body still ends");
        let with_trailers = request_body(b"x", false);
        let Some(processing_response::Response::RequestBody(b)) = &with_trailers[0].response else { panic!() };
        let m = b.response.as_ref().unwrap().body_mutation.as_ref().unwrap();
        let Some(body_mutation::Mutation::StreamedResponse(s)) = &m.mutation else { panic!() };
        assert!(!s.end_of_stream, "trailers end the stream instead");
    }

    #[test]
    fn an_immediate_answer_carries_status_body_and_retry_after() {
        let r = immediate(429, "application/json", b"{}", &[("retry-after", "2"), (crate::http::REQUEST_ID, "abc")]);
        let Some(processing_response::Response::ImmediateResponse(i)) = &r.response else { panic!() };
        assert_eq!(i.status.as_ref().unwrap().code, 429);
        assert_eq!(i.body, b"{}");
        let set: Vec<_> =
            i.headers.as_ref().unwrap().set_headers.iter().map(|h| h.header.clone().unwrap().key).collect();
        assert_eq!(set, ["content-type", "retry-after", "x-request-id"]);
    }
}
