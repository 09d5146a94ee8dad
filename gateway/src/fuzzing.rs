//! The request path the fuzzer drives (`gateway/fuzz`, `scripts/fuzz.sh`) and the
//! regression test replays (`gateway/tests/fuzz_regressions.rs`): everything the gateway
//! does with client bytes before an engine sees them, minus the sockets.
//!
//! Input layout: the bytes up to the first `\0` are a request head (as pingora hands it
//! over), the rest is the body. Invariants checked besides "no panic": routing fields
//! only come from JSON objects, the block hashes of the canonical prompt cover it, the
//! prefix index answers for what was inserted, and the routing decision is a candidate.

use crate::auth::{ApiKeyConfig, Authenticator};
use crate::config::PrefixIndexConfig;
use crate::policy::prefix_index::block_hashes;
use crate::policy::{Candidate, PolicyConfig, RouteInput};
use crate::prefix::PrefixTracker;
use crate::request::{canonical_prompt, check_head, routing_fields, UsageMeter};

/// Run the request path over `data`.
pub fn request_path(data: &[u8]) {
    let (head, body) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let fields = head.split(|&b| b == b'\n').count();
    let _ = check_head(head, fields, 65_536, 100);
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
    let _ = auth.authenticate(authorization);

    let parsed = routing_fields(body);
    let is_object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
        && serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|v| v.is_object());
    assert!(parsed.is_err() || is_object, "routing fields only come from JSON objects");

    let text = canonical_prompt(body);
    let cfg = PrefixIndexConfig { block_bytes: 16, max_bytes: 1 << 16, bytes_per_token: 4.0 };
    let hashes = block_hashes(text.as_bytes(), cfg.block_bytes);
    assert_eq!(hashes.len(), text.len() / cfg.block_bytes);
    let tracker = PrefixTracker::new(&cfg);
    tracker.insert(7, &hashes);
    let matched = tracker.matched_blocks(&hashes, &[(7, 0), (8, 0)]);
    assert!(matched[1] == 0 && matched[0] <= hashes.len());

    let candidates: Vec<Candidate> = (0..3)
        .map(|i| Candidate {
            index: i,
            key: 7 + i as u64,
            inflight: i as u64,
            signal: None,
            pending_prefill_tokens: 0,
            prefill_tokens_per_s: 0.0,
            matched_tokens: if i == 0 { cfg.tokens(matched[0] * cfg.block_bytes) } else { 0 },
        })
        .collect();
    let prompt_tokens = cfg.tokens(text.len());
    let input = RouteInput { model: "m", prompt_tokens, session: None };
    for policy in [PolicyConfig::default(), serde_yaml::from_str("{ type: least_load }").expect("least_load policy")] {
        let d = policy.build().select(&input, &candidates, &mut rand::rng());
        assert!(d.index < candidates.len());
    }

    let mut meter = UsageMeter::default();
    meter.observe(body);
    let _ = meter.used(prompt_tokens);
}
