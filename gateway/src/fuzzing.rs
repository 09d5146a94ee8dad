//! The request path the fuzzer drives (`gateway/fuzz`, `scripts/fuzz.sh`) and the
//! regression test replays (`gateway/tests/fuzz_regressions.rs`): everything the gateway
//! does with client bytes before an engine sees them, minus the sockets — the same
//! functions the proxy calls ([`crate::proxy::plan::plan_request`] among them), not a copy.
//! Built only with the `fuzzing` feature.
//!
//! Input layout: the bytes up to the first `\0` are a request head (read by the gateway's
//! own parser, [`RequestHead::parse`]; a head it refuses is still planned, from its
//! `name: value` lines, so the planner sees every input), the rest is the body. Invariants checked besides "no panic": a plan only comes
//! from a JSON object or a multipart form (`Content-Type: multipart/form-data; boundary=…`
//! in the head), an alias's rewritten body names its target where the client named the
//! alias, the canonical prompt's streaming visitor renders what a document tree
//! of the same body renders, the block hashes of the canonical prompt cover it, the prefix
//! index answers for what was inserted, and every policy's pick is a candidate.

use bytes::BytesMut;

use crate::active::Active;
use crate::auth::Authenticator;
use crate::config::ApiKeyConfig;
use crate::config::GatewayConfig;
use crate::downstream::RequestHead;
use crate::policy::{Candidate, PolicyConfig, RouteInput};
use crate::prefix::PrefixTracker;
use crate::proxy::plan::plan_request;
use crate::request::{canonical_prompt, canonical_prompt_from_tree, UsageMeter};

/// The config the fuzz target plans under: one backend serving `m`, the default `cost`
/// policy, a priority header, small prefix blocks.
const CONFIG: &str = "discovery:\n  static:\n    - url: http://127.0.0.1:9\n      models: [m]\n\
admission:\n  priority_header: x-priority\nprefix_index:\n  block_bytes: 16\n\
models:\n  a:\n    targets: [ { model: m, weight: 1 } ]\n";

/// The head as the gateway parses it (completed with an empty line); when it refuses it,
/// the head's `name: value` lines under a `POST /v1/chat/completions` request line.
fn request_head(head: &[u8]) -> RequestHead {
    let mut buf = BytesMut::from(head);
    if !head.ends_with(b"\r\n\r\n") {
        buf.extend_from_slice(b"\r\n\r\n");
    }
    if let Ok(Some(parsed)) = RequestHead::parse(&mut buf, 65_536, 100) {
        return parsed;
    }
    let lines = head.split(|&b| b == b'\n').skip(1).filter_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let colon = line.iter().position(|&b| b == b':')?;
        let name = std::str::from_utf8(&line[..colon]).ok()?.trim();
        Some((name, line[colon + 1..].trim_ascii()))
    });
    RequestHead::from_parts("POST", "/v1/chat/completions", lines)
}

/// [`crate::proxy::routes::normalize_target`]'s invariants on `target`.
fn target_is_normalized_once(target: &str) {
    let Ok(normal) = crate::proxy::routes::normalize_target(target) else { return };
    let path = normal.split('?').next().unwrap_or_default();
    assert!(path.starts_with('/'), "{target:?} → {normal:?}");
    assert!(!path[1..].split('/').rev().skip(1).any(|s| matches!(s, "" | "." | "..")), "{target:?} → {normal:?}");
    assert!(!path.split('/').any(|s| matches!(s, "." | "..")), "{target:?} → {normal:?}");
    let unreserved = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~');
    let escapes = path.as_bytes().windows(3).filter(|w| w[0] == b'%');
    assert!(
        escapes
            .clone()
            .all(|w| u8::from_str_radix(&String::from_utf8_lossy(&w[1..]), 16).is_ok_and(|c| !unreserved(c))),
        "{target:?} → {normal:?}"
    );
    assert_eq!(crate::proxy::routes::normalize_target(&normal).as_deref(), Ok(&*normal), "a fixed point");
}

/// Run the request path over `data`.
pub fn request_path(data: &[u8]) {
    let (head, body) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let auth = Authenticator::build(
        true,
        vec![ApiKeyConfig {
            tenant: "t".into(),
            key_sha256: "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08".into(),
            requests_per_second: None,
            burst: None,
            tokens_per_minute: None,
            priority: 0,
        }],
        None,
    );
    let authorization = head.split(|&b| b == b'\n').find_map(|l| l.strip_prefix(b"Authorization: "));
    let tenant = auth.authenticate(authorization).ok().flatten();

    if let Some(tree) = canonical_prompt_from_tree(body) {
        assert_eq!(canonical_prompt(body), tree, "the streaming visitor renders what the tree does");
    }
    // The prompt as an engine reads it (precise routing): a chat, a text or ids, or nothing;
    // never a panic. A chat has messages; ids are what the body lists.
    match crate::request::tokens::prompt_input(body) {
        Some(crate::request::tokens::PromptInput::Chat(m)) => assert!(!m.is_empty()),
        Some(crate::request::tokens::PromptInput::Ids(ids)) => assert!(!ids.is_empty()),
        Some(crate::request::tokens::PromptInput::Text(_)) | None => {}
    }
    // What the routing pass sees of the prompt is what the engine's reader gives.
    let limits = crate::request::PromptLimits::NONE;
    if let Ok((_, pass)) = crate::request::routing_fields_and_blocks(body, &limits, 64, true) {
        if let crate::request::tokens::SeenPrompt::Known(input) = pass.seen {
            assert_eq!(input, crate::request::tokens::prompt_input(body), "the routing pass sees the engine's prompt");
        }
    }

    let req = request_head(head);
    // The request target: normalized once, a fixed point after that, never a dot segment, an
    // empty segment or an escape of an unreserved character left.
    target_is_normalized_once(req.path_and_query());
    let active = Active::for_config(GatewayConfig::parse(CONFIG).expect("the fuzz config is valid"));
    let plan = plan_request(&req, body, &active, tenant.as_deref(), false);
    let is_object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
        && serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|v| v.is_object());
    let content_type = req.get_str("content-type").unwrap_or("");
    let boundary = crate::request::form_data_boundary(content_type).and_then(Result::ok);
    assert!(plan.is_err() || is_object || boundary.is_some(), "a plan only comes from a JSON object or a form");
    let Ok(plan) = plan else { return };
    // An alias's target replaces the model value and nothing else the planner reads.
    if plan.alias.is_some() {
        let rewritten = plan.engine_body(bytes::Bytes::copy_from_slice(body));
        let named = match boundary {
            Some(b) => crate::request::form_routing_fields(&rewritten, b).map(|f| f.model),
            None => crate::request::routing_fields(&rewritten, &active.config.limits.prompt_limits()).map(|f| f.model),
        };
        assert_eq!(named.ok().flatten().as_deref(), Some(plan.model.as_str()), "the rewritten body names the target");
    }
    if boundary.is_some() {
        assert!(plan.hashes.is_empty(), "a form has no prompt to hash");
        return;
    }

    let cfg = &active.config.prefix_index;
    let text = canonical_prompt(body);
    assert_eq!(
        plan.hashes,
        crate::policy::prefix_index::block_hashes(text.as_bytes(), cfg.block_bytes),
        "the block hashes are the canonical prompt's, hashed as it renders"
    );
    let tracker = PrefixTracker::new(cfg);
    tracker.insert(7, &plan.hashes);
    let matched = tracker.matched_blocks(&plan.hashes, &[(7, 0), (8, 0)]);
    assert!(matched[1] == 0 && matched[0] <= plan.hashes.len());

    let candidates: Vec<Candidate> = (0..3)
        .map(|i| Candidate {
            index: 10 + i,
            key: 7 + i as u64,
            inflight: i as u64,
            signal: None,
            pending_prefill_tokens: 0,
            prefill_tokens_per_s: 0.0,
            matched_tokens: if i == 0 { cfg.tokens(matched[0] * cfg.block_bytes).min(plan.prompt_tokens) } else { 0 },
        })
        .collect();
    let input = RouteInput { model: &plan.model, prompt_tokens: plan.prompt_tokens, session: plan.session.as_deref() };
    for policy in [PolicyConfig::default(), serde_yaml::from_str("{ type: least_load }").expect("least_load policy")] {
        let d = policy.build().select(&input, &candidates, &mut rand::rng());
        assert!(d.pick < candidates.len(), "the pick is a candidate");
    }

    let mut meter = UsageMeter::default();
    meter.observe(body);
    let _ = meter.used(plan.prompt_tokens);
}

/// The KV-event decoder ([`crate::kv_events::wire::decode_batch`]) on bytes an engine (or
/// anyone reaching its ZMQ port) sends: it never panics, refuses what is too large or too deep
/// without decoding it, and decodes the same bytes to the same batch.
pub fn kv_event_batch(data: &[u8]) {
    use crate::kv_events::wire::{decode_batch, DecodeError, MAX_PAYLOAD_BYTES};
    let first = decode_batch(data);
    if data.len() > MAX_PAYLOAD_BYTES {
        assert!(matches!(first, Err(DecodeError::TooLarge(_))));
    }
    let again = decode_batch(data);
    match (&first, &again) {
        (Ok(a), Ok(b)) => assert!(a.ts.to_bits() == b.ts.to_bits() && a.events == b.events),
        (Err(a), Err(b)) => assert_eq!(a, b),
        _ => panic!("decoding the same bytes twice disagreed"),
    }
}
