//! A request's life inside the engine: its tokens, progress and the incremental text it has
//! produced, with stop-condition checks. Its KV blocks are the
//! [`KvCacheManager`](crate::kv::KvCacheManager)'s.
//!
//! Text is produced incrementally the way vLLM and TGI do it: decode a short window of
//! recent tokens and emit only what is new, holding back output that ends in a broken
//! UTF-8 sequence (U+FFFD) or that could still become the start of a stop string.

use crate::tokenizer::{TokenId, Tokenizer};

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
    /// Stop strings; the output is cut before the first one.
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

/// Incremental detokenizer with stop-string hold-back.
#[derive(Debug, Clone, Default)]
pub struct OutputText {
    text: String,
    emitted: usize,
    prefix_offset: usize,
    read_offset: usize,
}

impl OutputText {
    /// Everything decoded so far (after any stop-string cut).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Decode the newest token of `output` and append its text.
    pub fn push_token(&mut self, tokenizer: &dyn Tokenizer, output: &[TokenId]) {
        let prefix = tokenizer.decode(&output[self.prefix_offset..self.read_offset]);
        let full = tokenizer.decode(&output[self.prefix_offset..]);
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(new) = full.get(prefix.len()..) {
                self.text.push_str(new);
                self.prefix_offset = self.read_offset;
                self.read_offset = output.len();
            }
        }
    }

    /// Look for a stop string in the text not yet emitted (and the few bytes before it
    /// that a stop string could straddle); cut the text there. True when one was found.
    pub fn apply_stop(&mut self, stop: &[String]) -> bool {
        let longest = stop.iter().map(String::len).max().unwrap_or(0);
        if longest == 0 {
            return false;
        }
        let mut from = self.emitted.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let cut = stop
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| from + p))
            .min();
        match cut {
            Some(c) => {
                self.text.truncate(c.max(self.emitted));
                true
            }
            None => false,
        }
    }

    /// The next piece of text to send. Unless `finished`, text that could be the start
    /// of a stop string is held back.
    pub fn take_delta(&mut self, stop: &[String], finished: bool) -> String {
        let mut end = self.text.len();
        if !finished {
            for s in stop {
                // longest suffix of text that is a proper prefix of s
                for k in (1..s.len()).rev() {
                    if self.text.len() >= k && s.is_char_boundary(k) && self.text.ends_with(&s[..k]) {
                        end = end.min(self.text.len() - k);
                        break;
                    }
                }
            }
        }
        let end = end.max(self.emitted);
        let delta = self.text[self.emitted..end].to_string();
        self.emitted = end;
        delta
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
    /// Decoded output.
    pub output: OutputText,
    /// Number of times it was preempted.
    pub num_preemptions: u32,
    /// Prompt tokens served from the prefix cache at its (last) admission.
    pub num_cached_tokens: usize,
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
            output: OutputText::default(),
            num_preemptions: 0,
            num_cached_tokens: 0,
        }
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

    /// Append a sampled token, update the text and say whether the request is done.
    pub fn append_token(
        &mut self,
        token: TokenId,
        tokenizer: &dyn Tokenizer,
        max_model_len: usize,
    ) -> Option<FinishReason> {
        self.tokens.push(token);
        let n_out = self.num_output_tokens();
        let past_min = n_out >= self.params.min_tokens;
        let is_eos = token == tokenizer.eos_token_id() && !self.params.ignore_eos;
        if past_min && (is_eos || self.params.stop_token_ids.contains(&token)) {
            return Some(FinishReason::Stop);
        }
        let start = self.num_prompt_tokens;
        self.output.push_token(tokenizer, &self.tokens[start..]);
        if past_min && self.output.apply_stop(&self.params.stop) {
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

    fn run(words: &[u64], stop: &[&str]) -> (Vec<String>, Option<FinishReason>) {
        let t = SimTokenizer::new();
        let params = SamplingParams {
            max_tokens: 100,
            stop: stop.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        let mut r = Request::new(1, vec![70000, 70001], params);
        let mut deltas = Vec::new();
        for &w in words {
            let fin = r.append_token(t.word_token(w), &t, 1000);
            deltas.push(r.output.take_delta(&r.params.stop, fin.is_some()));
            if fin.is_some() {
                return (deltas, fin);
            }
        }
        (deltas, None)
    }

    #[test]
    fn stop_string_cuts_output_and_holds_back_partial_matches() {
        // words 0,1,2 = " the", " of", " and"
        let (deltas, fin) = run(&[0, 1, 2, 0], &[" of and"]);
        assert_eq!(fin, Some(FinishReason::Stop));
        // " of" is held back (it could start " of and"), then the stop string cuts it off
        assert_eq!(deltas, vec![" the".to_string(), String::new(), String::new()]);
    }

    #[test]
    fn held_back_text_is_released_when_the_stop_does_not_match() {
        let (deltas, fin) = run(&[0, 1, 0], &[" of and"]);
        assert_eq!(fin, None);
        assert_eq!(deltas.concat(), " the of the");
        assert_eq!(deltas[1], "");
    }

    #[test]
    fn max_tokens_and_min_tokens() {
        let t = SimTokenizer::new();
        let p = SamplingParams { max_tokens: 3, min_tokens: 2, ..Default::default() };
        let mut r = Request::new(1, vec![9], p);
        assert_eq!(r.append_token(SimTokenizer::EOS, &t, 100), None, "EOS before min_tokens is ignored");
        assert_eq!(r.append_token(t.word_token(0), &t, 100), None);
        assert_eq!(r.append_token(t.word_token(0), &t, 100), Some(FinishReason::Length));
        let mut r = Request::new(2, vec![9; 4], SamplingParams { max_tokens: 10, ..Default::default() });
        assert_eq!(r.append_token(t.word_token(0), &t, 5), Some(FinishReason::Length), "max_model_len");
    }
}
