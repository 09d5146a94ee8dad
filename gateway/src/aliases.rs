//! Model aliases and weighted splits (canary, A/B): `models: { NAME: { targets } }` in the
//! config. A request for an alias goes to one of its target models, chosen by weight — the
//! same target for every request carrying the same session header (hashed, so every gateway
//! replica agrees), else at random — and its body's `model` value is rewritten to the target
//! (nothing else in the body changes). Pure: the choice and the rewrite; the proxy and the
//! Endpoint Picker apply them.
//!
//! ```yaml
//! models:
//!   chat-default:
//!     targets: [ { model: llama-3-8b-v1, weight: 90 }, { model: llama-3-8b-v2, weight: 10 } ]
//!     session_header: x-session-id     # default
//!     rewrite_response: false          # true: the response's `model` says the alias again
//! ```

use std::collections::BTreeMap;
use std::ops::Range;

use serde::Deserialize;

use crate::error::Errors;

/// Default `models.*.session_header`.
pub const DEFAULT_SESSION_HEADER: &str = "x-session-id";
/// Most targets of one alias.
pub const MAX_TARGETS: usize = 16;

/// One alias.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelAlias {
    /// The models it splits over, with their weights.
    pub targets: Vec<SplitTarget>,
    /// A request carrying this header always gets the same target for the same value.
    #[serde(default = "default_session_header")]
    pub session_header: String,
    /// Write the alias back into the response: every `"model":"TARGET"` (as engines write
    /// JSON, without spaces) of the body or of its SSE events says `"model":"ALIAS"`.
    #[serde(default)]
    pub rewrite_response: bool,
}

/// One target of an alias.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitTarget {
    /// A model the engines serve.
    pub model: String,
    /// Its share, relative to the others' (0: none; at least one must be positive).
    pub weight: u32,
}

fn default_session_header() -> String {
    DEFAULT_SESSION_HEADER.into()
}

/// Check every alias; errors name `models.NAME.…`.
pub fn validate(aliases: &BTreeMap<String, ModelAlias>, errs: &mut Errors) {
    for (name, alias) in aliases {
        let field = |f: &str| format!("models.{name}.{f}");
        if name.is_empty() || name.chars().any(char::is_control) {
            errs.add("models", name, "alias names are non-empty with no control characters");
        }
        if alias.targets.is_empty() || alias.targets.len() > MAX_TARGETS {
            errs.add(field("targets"), alias.targets.len(), format!("must list 1 to {MAX_TARGETS} targets"));
        }
        if alias.targets.iter().all(|t| t.weight == 0) {
            errs.add(field("targets"), "all weights 0", "at least one weight must be positive");
        }
        for (i, t) in alias.targets.iter().enumerate() {
            if t.model.is_empty() || t.model.chars().any(char::is_control) {
                errs.add(field(&format!("targets[{i}].model")), &t.model, "must name a model");
            } else if aliases.contains_key(&t.model) {
                errs.add(field(&format!("targets[{i}].model")), &t.model, "is an alias itself (aliases do not nest)");
            }
            if alias.targets[..i].iter().any(|o| o.model == t.model) {
                errs.add(field(&format!("targets[{i}].model")), &t.model, "listed twice");
            }
        }
        if alias.session_header.is_empty()
            || !alias.session_header.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            errs.add(field("session_header"), &alias.session_header, "must be a header name");
        }
    }
}

impl ModelAlias {
    /// The target for a request: by the session header's value when it has one (the same
    /// value always gets the same target, on every replica), else by `random` (uniform
    /// over u64). Either way each target's share is its weight over the total.
    pub fn choose(&self, session: Option<&[u8]>, random: u64) -> &str {
        let total: u64 = self.targets.iter().map(|t| u64::from(t.weight)).sum();
        let draw = match session {
            Some(s) => xxhash_rust::xxh3::xxh3_64(s),
            None => random,
        };
        // Multiply-shift: an unbiased enough point in 0..total for any u64 draw.
        let mut point = ((u128::from(draw) * u128::from(total.max(1))) >> 64) as u64;
        for t in &self.targets {
            let w = u64::from(t.weight);
            if point < w {
                return &t.model;
            }
            point -= w;
        }
        // Unreachable with a positive total (validated); the first target otherwise.
        &self.targets[0].model
    }
}

/// `body` with the bytes at `span` (a model value) replaced by `value`.
pub fn rewrite(body: &[u8], span: Range<usize>, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() - span.len() + value.len());
    out.extend_from_slice(&body[..span.start]);
    out.extend_from_slice(value);
    out.extend_from_slice(&body[span.end..]);
    out
}

/// Writes an alias back over its target's name in a response body that arrives in
/// pieces: every `"model":"TARGET"` becomes `"model":"ALIAS"`, also where a piece ends in
/// the middle of one (those bytes wait for the next piece; no other byte waits).
#[derive(Debug, Clone)]
pub struct Writeback {
    from: Vec<u8>,
    to: Vec<u8>,
    carry: Vec<u8>,
}

impl Writeback {
    /// Replace `target` by `alias` in `"model"` fields.
    pub fn new(target: &str, alias: &str) -> Self {
        let field = |name: &str| {
            let mut f = b"\"model\":".to_vec();
            f.extend_from_slice(&serde_json::to_vec(name).expect("a string serializes"));
            f
        };
        Writeback { from: field(target), to: field(alias), carry: Vec::new() }
    }

    /// The next piece of the body (`end`: the last), rewritten; bytes that might begin a
    /// match are held until the next piece shows whether they do.
    pub fn apply(&mut self, piece: &[u8], end: bool) -> Vec<u8> {
        let mut data = std::mem::take(&mut self.carry);
        data.extend_from_slice(piece);
        let mut out = Vec::with_capacity(data.len());
        let finder = memchr::memmem::Finder::new(&self.from);
        let mut at = 0;
        while let Some(i) = finder.find(&data[at..]) {
            out.extend_from_slice(&data[at..at + i]);
            out.extend_from_slice(&self.to);
            at += i + self.from.len();
        }
        let rest = &data[at..];
        // The longest tail of `rest` that begins `from` waits (unless the body ends here).
        let hold = if end {
            0
        } else {
            (1..self.from.len().min(rest.len() + 1))
                .rev()
                .find(|&n| self.from.starts_with(&rest[rest.len() - n..]))
                .unwrap_or(0)
        };
        out.extend_from_slice(&rest[..rest.len() - hold]);
        self.carry = rest[rest.len() - hold..].to_vec();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(a: u32, b: u32) -> ModelAlias {
        ModelAlias {
            targets: vec![SplitTarget { model: "a".into(), weight: a }, SplitTarget { model: "b".into(), weight: b }],
            session_header: DEFAULT_SESSION_HEADER.into(),
            rewrite_response: false,
        }
    }

    #[test]
    fn draws_follow_the_weights_and_sessions_stick() {
        let alias = split(90, 10);
        // Evenly spread draws over u64 (the midpoints of n equal slices): exactly the weights.
        let n = 10_000u64;
        let a = (0..n).filter(|i| alias.choose(None, (2 * i + 1) * (u64::MAX / (2 * n))) == "a").count();
        assert_eq!(a, 9_000);
        // A session always gets the same target, whatever the random draw.
        for s in ["user-1", "user-2", "user-3"] {
            let first = alias.choose(Some(s.as_bytes()), 0);
            assert!((1..50u64).all(|r| alias.choose(Some(s.as_bytes()), r * 7919) == first));
        }
        // Sessions spread by weight too.
        let a = (0..n).filter(|i| alias.choose(Some(format!("s{i}").as_bytes()), 0) == "a").count();
        assert!((8_700..=9_300).contains(&a), "{a}");
        // A zero weight never wins.
        assert!((0..1000u64).all(|i| split(1, 0).choose(None, i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) == "a"));
    }

    #[test]
    fn bad_aliases_are_refused_by_field() {
        let mut aliases = BTreeMap::new();
        aliases.insert("x".to_string(), split(0, 0));
        let mut nested = split(1, 1);
        nested.targets[0].model = "x".into();
        nested.targets[1].model = "x".into();
        nested.session_header = "bad header".into();
        aliases.insert("y".to_string(), nested);
        aliases.insert("z".to_string(), ModelAlias { targets: vec![], ..split(1, 1) });
        let mut errs = Errors::default();
        validate(&aliases, &mut errs);
        let text: Vec<String> = errs.list().iter().map(|e| e.to_string()).collect();
        let all = text.join("\n");
        for needle in [
            "models.x.targets: at least one weight must be positive",
            "models.y.targets[0].model: is an alias itself",
            "models.y.targets[1].model: listed twice",
            "models.y.session_header",
            "models.z.targets: must list 1 to 16 targets",
        ] {
            assert!(all.contains(needle), "missing {needle:?} in\n{all}");
        }
    }

    #[test]
    fn the_alias_is_written_back_across_any_split() {
        let body = br#"data: {"id":"x","model":"llama-v2","choices":[]}

data: {"model":"llama-v2","x":"\"model\":\"llama-v2"}

data: [DONE]

"#;
        let want = String::from_utf8(body.to_vec()).unwrap().replace(r#""model":"llama-v2""#, r#""model":"chat""#);
        // Every way of cutting the body in two, and byte by byte.
        for cut in 0..=body.len() {
            let mut w = Writeback::new("llama-v2", "chat");
            let mut out = w.apply(&body[..cut], false);
            out.extend(w.apply(&body[cut..], true));
            assert_eq!(String::from_utf8(out).unwrap(), want, "cut at {cut}");
        }
        let mut w = Writeback::new("llama-v2", "chat");
        let mut out = Vec::new();
        for (i, b) in body.iter().enumerate() {
            out.extend(w.apply(&[*b], i + 1 == body.len()));
        }
        assert_eq!(String::from_utf8(out).unwrap(), want);
        // Nothing that could not begin a match waits: an event's end leaves at once.
        let mut w = Writeback::new("llama-v2", "chat");
        assert_eq!(w.apply(b"data: {}\n\n", false), b"data: {}\n\n");
        assert_eq!(w.apply(br#"{"mod"#, false), b"{");
    }

    #[test]
    fn a_rewrite_changes_only_the_span() {
        let body = br#"{"model":"alias","messages":[]}"#;
        assert_eq!(rewrite(body, 9..16, br#""target-model""#), br#"{"model":"target-model","messages":[]}"#.to_vec());
    }
}
