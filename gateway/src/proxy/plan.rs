//! `read_and_plan`'s pure half: what the gateway decides about a request from its head and
//! body alone, before any queue or engine — [`plan_request`].
//!
//! The proxy and the fuzz target ([`crate::fuzzing`]) call the same function, so the fuzzer
//! exercises the real request path, not a copy of it.

use crate::active::Active;
use crate::auth::Tenant;
use crate::downstream::RequestHead;
use crate::error::ProxyError;
use crate::kv_events::prompt::PrecisePrompt;
use crate::request::tokens::SeenPrompt;
use crate::request::{
    canonical_prompt_blocks, form_data_boundary, form_routing_fields, routing_fields, routing_fields_and_blocks,
    PromptPass,
};

/// What a request will be routed and charged as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePlan {
    /// The model asked for, or the only one served when the request names none.
    pub model: String,
    /// Streamed response asked for.
    pub stream: bool,
    /// `max_tokens` (or `max_completion_tokens`), when a non-negative integer.
    pub max_tokens: Option<u64>,
    /// Admission priority: the priority header (at most the tenant's, or without keys
    /// `admission.max_header_priority`), else the tenant's, else 0.
    pub priority: i32,
    /// Token budget charge before routing: prompt estimate + n × max tokens (or the default).
    pub charge: u64,
    /// The prompt part of [`Self::charge`] (body bytes ÷ bytes per token).
    pub prompt_charge: u64,
    /// Block hashes of the canonical prompt (empty unless the policy reads prefixes).
    pub hashes: Vec<u64>,
    /// Estimated tokens of the canonical prompt (0 unless the policy reads prefixes).
    pub prompt_tokens: u64,
    /// The prompt tokenized as the engine will, with its block keys (a policy that reads
    /// prefixes, and `kv_events.tokenizer` set): filled in by the driver from
    /// [`Self::unread_prompt`], off the request's thread.
    pub precise: Option<PrecisePrompt>,
    /// The prompt as the routing pass read it, still to be tokenized into [`Self::precise`]
    /// (planned with a tokenizer, for a policy that reads prefixes).
    pub unread_prompt: Option<SeenPrompt>,
    /// The session header's value, for the `session` policy.
    pub session: Option<String>,
    /// The alias the client asked for, when `model` is its chosen target.
    pub alias: Option<String>,
    /// The body bytes to replace (the model value) and what with, for an alias.
    pub model_rewrite: Option<(std::ops::Range<usize>, Vec<u8>)>,
}

/// A request the planner refuses: the error to answer, and whether it asked for a stream
/// (for the access line; `false` when its fields could not be read).
#[derive(Debug)]
pub struct PlanRefused {
    /// What to answer.
    pub error: ProxyError,
    /// The body's `stream`, when it was read.
    pub stream: bool,
}

impl From<ProxyError> for PlanRefused {
    fn from(error: ProxyError) -> Self {
        PlanRefused { error, stream: false }
    }
}

/// Plan `body` (sent with `head`) under the config, policy and backends of `active`.
/// `tenant` is the API key's, when keys are on; `tokenizes`: the precise index has a prompt
/// tokenizer (the prompt is then kept for it, [`RoutePlan::unread_prompt`]).
///
/// # Errors
/// 400 for a body that is not a JSON object with well-typed routing fields, or one that
/// names no model while several are served.
pub fn plan_request(
    head: &RequestHead,
    body: &[u8],
    active: &Active,
    tenant: Option<&Tenant>,
    tokenizes: bool,
) -> Result<RoutePlan, PlanRefused> {
    let cfg = &active.config;
    let boundary = form_boundary(head).transpose().map_err(ProxyError::BadRequest)?;
    // A policy that reads prefixes gets the prompt's block hashes from the same pass.
    let (fields, blocks) = match boundary {
        Some(boundary) => (form_routing_fields(body, boundary)?, None),
        None if active.policy.uses_prefix() => {
            // The prompt as the engine reads it too, when the precise index will tokenize it.
            let (fields, pass) =
                routing_fields_and_blocks(body, &cfg.limits.prompt_limits(), cfg.prefix_index.block_bytes, tokenizes)?;
            (fields, Some(pass))
        }
        None => (routing_fields(body, &cfg.limits.prompt_limits())?, None),
    };
    let (model, alias, model_rewrite) = match fields.model {
        Some(asked) => match cfg.models.get(&asked) {
            Some(split) => {
                let session = head.get(split.session_header.as_str());
                let target = split.choose(session, rand::random()).to_string();
                // In a form the value is raw bytes; in JSON, a string literal.
                let value = match boundary {
                    Some(_) => target.clone().into_bytes(),
                    None => serde_json::to_vec(&target).expect("a string serializes"),
                };
                let rewrite = fields.model_span.clone().map(|span| (span, value));
                (target, Some(asked), rewrite)
            }
            None => (asked, None, None),
        },
        None => match active.cluster.models().as_slice() {
            [only] => (only.clone(), None, None),
            _ => {
                let error = ProxyError::BadRequest("model is required".into());
                return Err(PlanRefused { error, stream: fields.stream });
            }
        },
    };
    // The header may lower a key's priority, never raise it; without keys it is capped.
    let ceiling = tenant.map_or(cfg.admission.max_header_priority, |t| t.priority);
    let asked = cfg
        .admission
        .priority_header
        .as_ref()
        .and_then(|h| head.get_str(h.as_str()))
        .and_then(|v| v.trim().parse::<i32>().ok());
    let priority = match asked {
        Some(p) => p.min(ceiling),
        None => tenant.map_or(0, |t| t.priority),
    };
    let prompt_charge = cfg.prefix_index.tokens(body.len());
    // Every choice may run to its limit.
    let output = fields.choices.saturating_mul(fields.max_tokens.unwrap_or(cfg.auth.default_max_tokens));
    let charge = prompt_charge.saturating_add(output);
    let mut plan = RoutePlan {
        model,
        stream: fields.stream,
        max_tokens: fields.max_tokens,
        priority,
        charge,
        prompt_charge,
        hashes: Vec::new(),
        prompt_tokens: 0,
        precise: None,
        unread_prompt: None,
        session: None,
        alias,
        model_rewrite,
    };
    plan.fit_policy_with(head, body, active, tokenizes, boundary.is_some(), blocks);
    Ok(plan)
}

/// The multipart boundary when the request is a `multipart/form-data` upload.
fn form_boundary(head: &RequestHead) -> Option<Result<&str, String>> {
    let content_type = head.get_str("content-type")?;
    form_data_boundary(content_type)
}

impl RoutePlan {
    /// The writer of the alias back into the response, when the alias asks for it.
    pub fn writeback(&self, active: &Active) -> Option<Box<crate::aliases::Writeback>> {
        let alias = self.alias.as_deref()?;
        active.config.models.get(alias).filter(|s| s.rewrite_response)?;
        Some(Box::new(crate::aliases::Writeback::new(&self.model, alias)))
    }

    /// The body the engine gets: the client's bytes, with an alias's `model` value rewritten
    /// to its target (the one change the gateway makes to a body).
    pub fn engine_body(&self, body: bytes::Bytes) -> bytes::Bytes {
        match &self.model_rewrite {
            None => body,
            Some((span, value)) => crate::aliases::rewrite(&body, span.clone(), value).into(),
        }
    }

    /// Fill in what `active`'s policy reads: the canonical prompt's block hashes and token
    /// estimate, and the prompt to tokenize for its precise block keys when `tokenizes`
    /// (prefix-aware policies); the session header (`session`). Called again when a reload
    /// changed the policy while the request waited in the queue.
    pub fn fit_policy(&mut self, head: &RequestHead, body: &[u8], active: &Active, tokenizes: bool) {
        let form = form_boundary(head).is_some();
        self.fit_policy_with(head, body, active, tokenizes, form, None);
    }

    /// [`Self::fit_policy`], knowing whether the body is a form, and given the block hashes,
    /// prompt length and seen prompt when they were read already (with the routing fields,
    /// under `active`'s block size).
    fn fit_policy_with(
        &mut self,
        head: &RequestHead,
        body: &[u8],
        active: &Active,
        tokenizes: bool,
        form: bool,
        pass: Option<PromptPass>,
    ) {
        let policy = &active.policy;
        let pcfg = &active.config.prefix_index;
        // A form (an audio upload) has no prompt to hash.
        if policy.uses_prefix() && !form {
            let (blocks, seen) = match pass {
                Some(p) => (p.blocks, p.seen),
                None => (canonical_prompt_blocks(body, pcfg.block_bytes), SeenPrompt::Unknown),
            };
            self.hashes = blocks.0;
            self.prompt_tokens = pcfg.tokens(blocks.1);
            if self.precise.is_none() && tokenizes {
                self.unread_prompt = Some(seen);
            }
        } else {
            self.hashes = Vec::new();
            self.prompt_tokens = 0;
            self.precise = None;
            self.unread_prompt = None;
        }
        self.session = policy.session_header().and_then(|h| head.get_str(h)).map(str::to_owned);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GatewayConfig;

    fn active(extra: &str) -> Active {
        let yaml = format!(
            "discovery:\n  static:\n    - url: http://127.0.0.1:9\n      models: [m]\nadmission:\n  priority_header: x-priority\n  max_header_priority: 5\n{extra}"
        );
        Active::for_config(GatewayConfig::parse(&yaml).unwrap())
    }

    fn head(headers: &[(&str, &str)]) -> RequestHead {
        RequestHead::from_parts("POST", "/v1/chat/completions", headers.iter().map(|(n, v)| (*n, v.as_bytes())))
    }

    #[test]
    fn a_plan_names_model_priority_charge_and_prefix() {
        let a = active("");
        let body =
            format!(r#"{{"messages":[{{"role":"user","content":"{}"}}],"max_tokens":10}}"#, "hello ".repeat(200));
        let p = plan_request(&head(&[("x-priority", " 3 ")]), body.as_bytes(), &a, None, false).unwrap();
        assert_eq!((p.model.as_str(), p.stream, p.max_tokens, p.priority), ("m", false, Some(10), 3));
        assert_eq!(p.charge, p.prompt_charge + 10);
        assert!(!p.hashes.is_empty() && p.prompt_tokens > 0, "cost reads prefixes: {p:?}");
        assert_eq!(p.session, None);
        let p = plan_request(&head(&[("x-priority", "high")]), b"{\"model\":\"x\"}", &a, None, false).unwrap();
        assert_eq!((p.model.as_str(), p.priority), ("x", 0));
    }

    #[test]
    fn policies_that_do_not_read_prompts_get_no_hashes_and_sessions_get_their_header() {
        let a = active("policy:\n  type: session\n  header: x-session\n");
        let p = plan_request(
            &head(&[("x-session", "abc")]),
            br#"{"prompt":"once upon a time, long ago"}"#,
            &a,
            None,
            false,
        )
        .unwrap();
        assert_eq!(p.session.as_deref(), Some("abc"));
        let a = active("policy:\n  type: round_robin\n");
        let p = plan_request(&head(&[]), br#"{"prompt":"once upon a time, long ago"}"#, &a, None, false).unwrap();
        assert!(p.hashes.is_empty() && p.prompt_tokens == 0);
    }

    #[test]
    fn the_charge_follows_the_engines_precedence_and_never_overflows() {
        let a = active("");
        let p =
            plan_request(&head(&[]), br#"{"max_tokens":1,"max_completion_tokens":100000}"#, &a, None, false).unwrap();
        assert_eq!(p.charge, p.prompt_charge + 100_000);
        let p =
            plan_request(&head(&[]), br#"{"max_tokens":18446744073709551615,"prompt":"a"}"#, &a, None, false).unwrap();
        assert_eq!(p.charge, u64::MAX);
        // Every choice is charged; numbers are read as the engine reads them.
        let p = plan_request(&head(&[]), br#"{"n":16,"max_tokens":900,"prompt":"a"}"#, &a, None, false).unwrap();
        assert_eq!(p.charge, p.prompt_charge + 16 * 900);
        let p = plan_request(&head(&[]), br#"{"n":"2","max_completion_tokens":1e5}"#, &a, None, false).unwrap();
        assert_eq!(p.charge, p.prompt_charge + 200_000);
    }

    #[test]
    fn a_priority_header_cannot_raise_a_request_past_the_cap() {
        let a = active("");
        let body = b"{\"model\":\"m\"}";
        let asked = |v: &str| plan_request(&head(&[("x-priority", v)]), body, &a, None, false).unwrap().priority;
        assert_eq!((asked("9"), asked("5"), asked("-2")), (5, 5, -2), "capped at max_header_priority");
        let keys = Active::for_config(
            GatewayConfig::parse(
                "discovery:\n  static:\n    - url: http://127.0.0.1:9\n      models: [m]\nadmission:\n  priority_header: x-priority\n  max_header_priority: 100\nauth:\n  keys:\n    - { tenant: t, key_sha256: \"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\", priority: 3 }\n",
            )
            .unwrap(),
        );
        let tenant = keys.auth.authenticate(Some(b"Bearer test")).unwrap().unwrap();
        let with_key =
            |v: &str| plan_request(&head(&[("x-priority", v)]), body, &keys, Some(&tenant), false).unwrap().priority;
        assert_eq!((with_key("50"), with_key("1")), (3, 1), "a key's priority can only be lowered");
        assert_eq!(plan_request(&head(&[]), body, &keys, Some(&tenant), false).unwrap().priority, 3);
    }

    #[test]
    fn bad_bodies_are_400() {
        let a = active("");
        for body in [&b"[]"[..], b"{\"model\":1}", b"{\"stream\":\"yes\"}"] {
            assert_eq!(plan_request(&head(&[]), body, &a, None, false).unwrap_err().error.status(), 400);
        }
    }
}
