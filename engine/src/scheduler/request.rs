//! A request's life inside the scheduler: its tokens and progress, with the stop conditions
//! of token space (EOS, stop token ids, `max_tokens`, the context length). Its KV blocks are
//! the [`KvCacheManager`](crate::kv::KvCacheManager)'s; its text and stop strings the
//! [output processor's](crate::output_processor).

use crate::structured::Constraint;
use crate::tokenizer::TokenId;

/// Engine-wide request id.
pub type RequestId = u64;

/// Generation parameters the engine acts on (validated by the server).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Maximum tokens to generate.
    pub max_tokens: usize,
    /// Tokens to generate before EOS or stop strings may end the request.
    pub min_tokens: usize,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Stop strings; the output is cut before the first one (by the output processor).
    pub stop: Vec<String>,
    /// Extra token ids that end the request.
    pub stop_token_ids: Vec<TokenId>,
    /// Sampling temperature (0 = greedy).
    pub temperature: f32,
    /// Nucleus sampling mass.
    pub top_p: f32,
    /// Top-k cutoff (0 or -1 = off).
    pub top_k: i32,
    /// Drop tokens less likely than `min_p` × the most likely one (0 = off).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of tokens already seen, prompt
    /// included (1 = off).
    pub repetition_penalty: f32,
    /// Subtract this once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtract this × the count of every token already generated.
    pub frequency_penalty: f32,
    /// Seed of this request's sampler.
    pub seed: u64,
    /// Log probabilities to return per generated token: `None` for none, `Some(n)` for the
    /// chosen token's and the `n` most likely tokens'.
    pub logprobs: Option<usize>,
    /// An embedding request: the prompt's final hidden states are mean-pooled and the
    /// request ends after its prefill, generating nothing (its whole prompt is computed:
    /// no prefix-cache hits).
    pub pooling: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            min_tokens: 0,
            ignore_eos: false,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            logprobs: None,
            pooling: false,
        }
    }
}

/// Why a request ended (OpenAI's `finish_reason`, plus abort).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the model's context length.
    Length,
    /// The client went away.
    Abort,
}

impl FinishReason {
    /// The label used by OpenAI responses and vLLM's `finished_reason` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// One request as the scheduler sees it.
#[derive(Debug, Clone)]
pub struct Request {
    /// Id.
    pub id: RequestId,
    /// Prompt tokens followed by generated tokens.
    pub tokens: Vec<TokenId>,
    /// Length of the prompt part of `tokens`.
    pub num_prompt_tokens: usize,
    /// Tokens whose KV has been computed (and is held in its blocks).
    pub num_computed_tokens: usize,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Number of times it was preempted.
    pub num_preemptions: u32,
    /// Prompt tokens served from the prefix cache at its (last) admission.
    pub num_cached_tokens: usize,
    /// The grammar its output must follow (structured output), if any.
    pub constraint: Option<Constraint>,
    /// A pooling request's sum of hidden states over the prompt tokens computed so far.
    pub pool_sum: Vec<f32>,
}

impl Request {
    /// A new waiting request.
    pub fn new(id: RequestId, prompt: Vec<TokenId>, params: SamplingParams) -> Self {
        Request {
            id,
            num_prompt_tokens: prompt.len(),
            tokens: prompt,
            num_computed_tokens: 0,
            params,
            num_preemptions: 0,
            num_cached_tokens: 0,
            constraint: None,
            pool_sum: Vec::new(),
        }
    }

    /// The same request, its output constrained by `constraint`.
    pub fn with_constraint(mut self, constraint: Option<Constraint>) -> Self {
        self.constraint = constraint;
        self
    }

    /// Generated tokens so far.
    pub fn output_tokens(&self) -> &[TokenId] {
        &self.tokens[self.num_prompt_tokens..]
    }

    /// Number of generated tokens.
    pub fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    /// May EOS (or a stop token) end the request now?
    pub fn eos_allowed(&self) -> bool {
        !self.params.ignore_eos && self.num_output_tokens() >= self.params.min_tokens
    }

    /// Append a sampled token and say whether the request is done in token space: EOS or a
    /// stop token id (after `min_tokens`; EOS unless `ignore_eos`) is `Stop`, `max_tokens` or
    /// `max_model_len` is `Length`. (Stop strings are the output processor's.)
    pub fn append_token(&mut self, token: TokenId, eos: TokenId, max_model_len: usize) -> Option<FinishReason> {
        self.tokens.push(token);
        let n_out = self.num_output_tokens();
        let past_min = n_out >= self.params.min_tokens;
        let is_eos = token == eos && !self.params.ignore_eos;
        if past_min && (is_eos || self.params.stop_token_ids.contains(&token)) {
            return Some(FinishReason::Stop);
        }
        if n_out >= self.params.max_tokens || self.tokens.len() >= max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::SimTokenizer;

    #[test]
    fn max_tokens_and_min_tokens() {
        let t = SimTokenizer::new();
        let eos = SimTokenizer::EOS;
        let p = SamplingParams { max_tokens: 3, min_tokens: 2, ..Default::default() };
        let mut r = Request::new(1, vec![9], p);
        assert_eq!(r.append_token(SimTokenizer::EOS, eos, 100), None, "EOS before min_tokens is ignored");
        assert_eq!(r.append_token(t.word_token(0), eos, 100), None);
        assert_eq!(r.append_token(t.word_token(0), eos, 100), Some(FinishReason::Length));
        let mut r = Request::new(2, vec![9; 4], SamplingParams { max_tokens: 10, ..Default::default() });
        assert_eq!(r.append_token(t.word_token(0), eos, 5), Some(FinishReason::Length), "max_model_len");
    }

    #[test]
    fn eos_and_stop_token_ids_stop_after_min_tokens() {
        let eos = SimTokenizer::EOS;
        let p = SamplingParams { max_tokens: 10, stop_token_ids: vec![7], ..Default::default() };
        let mut r = Request::new(1, vec![9], p.clone());
        assert_eq!(r.append_token(7, eos, 100), Some(FinishReason::Stop));
        let mut r = Request::new(2, vec![9], p.clone());
        assert_eq!(r.append_token(eos, eos, 100), Some(FinishReason::Stop));
        let mut r = Request::new(3, vec![9], SamplingParams { ignore_eos: true, ..p });
        assert_eq!(r.append_token(eos, eos, 100), None, "ignore_eos");
    }
}
