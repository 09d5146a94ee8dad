//! The output processor: from the scheduler's tokens to the text a client receives (vLLM V1's
//! `OutputProcessor`), on the runtime's side of the engine core.
//!
//! The scheduler decides in token space only: a request ends there on EOS or one of its stop
//! token ids (`stop`, after `min_tokens`), or at `max_tokens` or the model's context length
//! (`length`). Text is this module's business: each request's new tokens are detokenized
//! incrementally ([`OutputText`]) and its stop *strings* are looked for in the text. When one
//! appears (after `min_tokens`), the output is cut before it and the request ends with
//! `stop` — also when the scheduler ended it for length with that very token. If the scheduler
//! still runs the request, [`OutputProcessor::process`] lists it in [`Processed::stopped`]: the
//! caller aborts it in the scheduler at once, which frees its blocks before the next step.
//!
//! Text is produced incrementally the way vLLM and TGI do it: decode a short window of recent
//! tokens and emit only what is new, holding back output that ends in a broken UTF-8 sequence
//! (U+FFFD) or that could still become the start of a stop string. The token that ends a
//! request as EOS or a stop token adds no text.

use std::collections::HashMap;
use std::sync::Arc;

use crate::scheduler::{FinishReason, RequestId, SamplingParams, TokenLogprobs, TokenOutput};
use crate::tokenizer::{TokenId, Tokenizer};

/// Something the runtime must tell a client.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New output of a request (text may be empty while held back).
    Token {
        /// Which request.
        id: RequestId,
        /// New text.
        text: String,
        /// The token's log probabilities, when asked for.
        logprobs: Option<TokenLogprobs>,
    },
    /// The request ended; no further events follow.
    Finished {
        /// Which request.
        id: RequestId,
        /// Remaining text.
        text: String,
        /// Why.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
        /// Prompt tokens that were served from the prefix cache.
        cached_tokens: usize,
        /// The last token's log probabilities, when asked for.
        logprobs: Option<TokenLogprobs>,
        /// A pooling request's embedding (not normalized).
        embedding: Option<Vec<f32>>,
    },
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

/// One request's text state.
#[derive(Debug)]
struct RequestText {
    stop: Vec<String>,
    min_tokens: usize,
    /// The generated tokens so far.
    output: Vec<TokenId>,
    text: OutputText,
}

/// What one step's outputs became.
#[derive(Debug, Default, PartialEq)]
pub struct Processed {
    /// Events for the clients, in output order.
    pub events: Vec<Event>,
    /// Requests that a stop string ended while the scheduler still runs them: abort them
    /// there (their `Finished` event is among `events`).
    pub stopped: Vec<RequestId>,
}

/// The output processor. See the module documentation.
pub struct OutputProcessor {
    tokenizer: Arc<dyn Tokenizer>,
    requests: HashMap<RequestId, RequestText>,
}

impl OutputProcessor {
    /// A processor decoding with `tokenizer`.
    pub fn new(tokenizer: Arc<dyn Tokenizer>) -> Self {
        OutputProcessor { tokenizer, requests: HashMap::new() }
    }

    /// Track a new request (before the scheduler sees it).
    pub fn add(&mut self, id: RequestId, params: &SamplingParams) {
        let state = RequestText {
            stop: params.stop.clone(),
            min_tokens: params.min_tokens,
            output: Vec::new(),
            text: OutputText::default(),
        };
        self.requests.insert(id, state);
    }

    /// Forget a request that was aborted (its client went away).
    pub fn abort(&mut self, id: RequestId) {
        self.requests.remove(&id);
    }

    /// Requests being tracked.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// No request is tracked.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Turn one step's token outputs into events (see the module documentation).
    pub fn process(&mut self, outputs: Vec<TokenOutput>) -> Processed {
        let mut done = Processed { events: Vec::with_capacity(outputs.len()), stopped: Vec::new() };
        for o in outputs {
            let Some(req) = self.requests.get_mut(&o.id) else { continue };
            req.output.push(o.token);
            let mut finished = o.finished;
            if !o.stop_token {
                req.text.push_token(self.tokenizer.as_ref(), &req.output);
                if req.output.len() >= req.min_tokens && req.text.apply_stop(&req.stop) {
                    if finished.is_none() {
                        done.stopped.push(o.id);
                    }
                    finished = Some(FinishReason::Stop);
                }
            }
            let text = req.text.take_delta(&req.stop, finished.is_some());
            let event = match finished {
                None => Event::Token { id: o.id, text, logprobs: o.logprobs },
                Some(reason) => {
                    self.requests.remove(&o.id);
                    Event::Finished {
                        id: o.id,
                        text,
                        reason,
                        prompt_tokens: o.prompt_tokens,
                        completion_tokens: o.completion_tokens,
                        cached_tokens: o.cached_tokens,
                        logprobs: o.logprobs,
                        embedding: o.embedding,
                    }
                }
            };
            done.events.push(event);
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::SimTokenizer;

    /// Feed the words `words` (as the scheduler would, ending at `max_tokens` = 100) to a
    /// processor with stop strings `stop`; the text deltas and how it ended.
    fn run(words: &[u64], stop: &[&str]) -> (Vec<String>, Option<FinishReason>, Vec<RequestId>) {
        let t = Arc::new(SimTokenizer::new());
        let params = SamplingParams {
            max_tokens: 100,
            stop: stop.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        let mut p = OutputProcessor::new(t.clone());
        p.add(1, &params);
        let (mut deltas, mut stopped) = (Vec::new(), Vec::new());
        for (i, &w) in words.iter().enumerate() {
            let out = TokenOutput {
                id: 1,
                token: t.word_token(w),
                logprobs: None,
                finished: None,
                stop_token: false,
                embedding: None,
                prompt_tokens: 2,
                completion_tokens: i + 1,
                cached_tokens: 0,
            };
            let done = p.process(vec![out]);
            stopped.extend(done.stopped);
            match done.events.into_iter().next() {
                Some(Event::Token { text, .. }) => deltas.push(text),
                Some(Event::Finished { text, reason, .. }) => {
                    deltas.push(text);
                    return (deltas, Some(reason), stopped);
                }
                None => panic!("no event"),
            }
        }
        (deltas, None, stopped)
    }

    #[test]
    fn stop_string_cuts_output_and_holds_back_partial_matches() {
        // words 0,1,2 = " the", " of", " and"
        let (deltas, fin, stopped) = run(&[0, 1, 2, 0], &[" of and"]);
        assert_eq!(fin, Some(FinishReason::Stop));
        // " of" is held back (it could start " of and"), then the stop string cuts it off
        assert_eq!(deltas, vec![" the".to_string(), String::new(), String::new()]);
        assert_eq!(stopped, vec![1], "the scheduler still runs it: the caller must abort it");
    }

    #[test]
    fn held_back_text_is_released_when_the_stop_does_not_match() {
        let (deltas, fin, _) = run(&[0, 1, 0], &[" of and"]);
        assert_eq!(fin, None);
        assert_eq!(deltas.concat(), " the of the");
        assert_eq!(deltas[1], "");
    }

    #[test]
    fn the_scheduler_finish_wins_except_that_a_stop_string_turns_length_into_stop() {
        let t = Arc::new(SimTokenizer::new());
        let params = SamplingParams { stop: vec![" of".into()], min_tokens: 1, ..Default::default() };
        let mut p = OutputProcessor::new(t.clone());
        let out = |id, w: u64, finished| TokenOutput {
            id,
            token: t.word_token(w),
            logprobs: None,
            finished,
            stop_token: finished == Some(FinishReason::Stop),
            embedding: None,
            prompt_tokens: 3,
            completion_tokens: 1,
            cached_tokens: 2,
        };
        // EOS (the scheduler's `stop`): the token adds no text, nothing to abort.
        p.add(1, &params);
        let done = p.process(vec![TokenOutput { token: SimTokenizer::EOS, ..out(1, 0, Some(FinishReason::Stop)) }]);
        assert!(done.stopped.is_empty());
        let want = Event::Finished {
            id: 1,
            text: String::new(),
            reason: FinishReason::Stop,
            prompt_tokens: 3,
            completion_tokens: 1,
            cached_tokens: 2,
            logprobs: None,
            embedding: None,
        };
        assert_eq!(done.events, vec![want]);
        // The last allowed token completes a stop string: `stop`, text cut, already freed.
        p.add(2, &params);
        let done = p.process(vec![out(2, 1, Some(FinishReason::Length))]);
        assert!(done.stopped.is_empty());
        assert!(matches!(&done.events[0], Event::Finished { reason: FinishReason::Stop, text, .. } if text.is_empty()));
        // Length without a stop string stays length, with its text.
        p.add(3, &params);
        let done = p.process(vec![out(3, 0, Some(FinishReason::Length))]);
        assert!(
            matches!(&done.events[0], Event::Finished { reason: FinishReason::Length, text, .. } if text == " the")
        );
        assert!(p.is_empty(), "finished requests are forgotten");
        // Outputs of requests it does not track (aborted) are dropped.
        assert_eq!(p.process(vec![out(9, 0, None)]), Processed::default());
    }

    #[test]
    fn stop_strings_wait_for_min_tokens() {
        let t = Arc::new(SimTokenizer::new());
        let params = SamplingParams { stop: vec![" the".into()], min_tokens: 2, ..Default::default() };
        let mut p = OutputProcessor::new(t.clone());
        p.add(1, &params);
        let out = |w: u64, n| TokenOutput {
            id: 1,
            token: t.word_token(w),
            logprobs: None,
            finished: None,
            stop_token: false,
            embedding: None,
            prompt_tokens: 1,
            completion_tokens: n,
            cached_tokens: 0,
        };
        let first = p.process(vec![out(0, 1)]);
        assert!(first.stopped.is_empty() && matches!(first.events[0], Event::Token { .. }));
        let second = p.process(vec![out(0, 2)]);
        assert_eq!(second.stopped, vec![1]);
    }
}
