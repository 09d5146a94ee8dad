//! The `sim` backend: a calibrated GPU timing model in place of a forward pass.
//!
//! It runs under the real scheduler and block pool; only the forward pass is replaced.
//! Each step's duration comes from [`roofline::step_time`] for the chosen
//! [`profiles::SimProfile`]; tokens are deterministic words drawn from the request's seed
//! and output position, so the same request with the same seed always produces the same
//! text, and the text re-tokenizes to the same ids (multi-turn prefixes hit the cache).
//!
//! End of sequence: when EOS is allowed (`ignore_eos` off, `min_tokens` reached), each
//! generated token is EOS with probability 1/[`EOS_ONE_IN`], giving a geometric output
//! length with that mean, like a chat model that stops on its own.
//!
//! With a real model's tokenizer (`--tokenizer`), the words are that tokenizer's ids of the
//! same words ([`SimBackend::with_tokenizer`]) and EOS is its end-of-sequence token.
//!
//! Structured output: when a grammar constrains the request, the token is drawn among those
//! it allows ([`SimBackend::constrained_token`]): the position's word when allowed, else
//! another word, a letter, digit or punctuation; now and then, and always after
//! [`WRAP_UP_AFTER`] tokens, a token that closes what is open (end, `"`, `]`, `}`, `,`), so
//! the output completes well within `max_tokens`.

pub mod calibration;
pub mod profiles;
pub mod roofline;

use super::{Backend, BackendFailure, StepOutput};
use crate::scheduler::{Sampled, SeqView};
use crate::tokenizer::{SimTokenizer, TokenId, Tokenizer, WORDS};
pub use profiles::{profile, SimProfile, PROFILE_NAMES};
pub use roofline::{kv_cache_blocks, step_time, StepShape};

/// Mean generated length when EOS is allowed.
pub const EOS_ONE_IN: u64 = 200;

/// Output position after which a constrained request closes what is open.
pub const WRAP_UP_AFTER: usize = 24;

/// Closers, in the order they are preferred when wrapping up (EOS comes first): what ends
/// a JSON string, array or object, then punctuation that moves a pattern along.
const CLOSERS: &[&str] = &["\"", "]", "}", ",", "@", ".", "-", ":", "/", "_", " "];
/// Single characters a constrained request may spell with.
const SPELLING: &str = "abcdefghijklmnopqrstuvwxyz0123456789 .-_:";

/// The simulated backend.
#[derive(Debug, Clone)]
pub struct SimBackend {
    profile: SimProfile,
    /// The ids of the words it generates.
    words: Vec<TokenId>,
    eos: TokenId,
    /// EOS and the closers' ids, preferred when a constrained request wraps up.
    closers: Vec<TokenId>,
    /// Single-character tokens ([`SPELLING`]) for constrained requests.
    spelling: Vec<TokenId>,
}

/// The ids of `texts` that are single tokens under `one`.
fn single_tokens<'a>(texts: impl Iterator<Item = &'a str>, one: impl Fn(&str) -> Vec<TokenId>) -> Vec<TokenId> {
    texts
        .filter_map(|t| match one(t).as_slice() {
            [id] => Some(*id),
            _ => None,
        })
        .collect()
}

impl SimBackend {
    /// A backend modelling `profile`, generating the simulator tokenizer's words.
    pub fn new(profile: SimProfile) -> Self {
        let sim = SimTokenizer::new();
        let words = (0..WORDS.len() as u64).map(|i| sim.word_token(i)).collect();
        // The simulator's tokenizer hashes letters in prompts; its byte tokens spell them.
        let byte = |t: &str| t.bytes().map(|b| SimTokenizer::BYTE_BASE + TokenId::from(b)).collect();
        let eos = SimTokenizer::EOS;
        let closers = [eos].into_iter().chain(single_tokens(CLOSERS.iter().copied(), byte)).collect();
        let spelling = single_tokens(SPELLING.split("").filter(|c| !c.is_empty()), byte);
        SimBackend { profile, words, eos, closers, spelling }
    }

    /// A backend generating the same words as `tokenizer` encodes them (each word's first
    /// token, with its leading space), ending on its EOS.
    pub fn with_tokenizer(profile: SimProfile, tokenizer: &dyn Tokenizer) -> Self {
        let mut words: Vec<TokenId> =
            WORDS.iter().filter_map(|w| tokenizer.encode(&format!(" {w}")).first().copied()).collect();
        let eos = tokenizer.eos_token_id();
        words.retain(|&id| id != eos);
        if words.is_empty() {
            return SimBackend::new(profile);
        }
        let encode = |t: &str| tokenizer.encode(t);
        let closers = [eos].into_iter().chain(single_tokens(CLOSERS.iter().copied(), encode)).collect();
        let spelling = single_tokens(SPELLING.split("").filter(|c| !c.is_empty()), encode);
        SimBackend { profile, words, eos, closers, spelling }
    }

    /// The token generated at output position `pos` for `seed` under a grammar that allows
    /// only `allowed` (see the module documentation).
    pub fn constrained_token(&self, seed: u64, pos: usize, allowed: &toktrie::SimpleVob) -> TokenId {
        let r = splitmix64(seed ^ splitmix64(pos as u64 + 1));
        let ok = |t: &TokenId| (*t as usize) < allowed.len() && allowed.is_allowed(*t);
        if pos >= WRAP_UP_AFTER || r.is_multiple_of(5) {
            if let Some(&t) = self.closers.iter().find(|t| ok(t)) {
                return t;
            }
        }
        // From a seeded offset: the position's word first, then the next allowed one.
        let from = |list: &[TokenId]| {
            let start = ((r >> 8) % list.len().max(1) as u64) as usize;
            list.iter().cycle().skip(start).take(list.len()).find(|t| ok(t)).copied()
        };
        from(&self.words)
            .or_else(|| from(&self.spelling))
            .or_else(|| allowed.first_bit_set().map(|t| t as TokenId))
            .unwrap_or(self.eos)
    }

    /// The token generated at output position `pos` for `seed`.
    pub fn token_at(&self, seed: u64, pos: usize, eos_allowed: bool) -> TokenId {
        let r = splitmix64(seed ^ splitmix64(pos as u64 + 1));
        if eos_allowed && r.is_multiple_of(EOS_ONE_IN) {
            self.eos
        } else {
            self.words[((r >> 8) % self.words.len() as u64) as usize]
        }
    }
}

impl Backend for SimBackend {
    fn execute(&mut self, batch: &[SeqView<'_>]) -> Result<StepOutput, BackendFailure> {
        let shape = StepShape::of(batch);
        let sampled = batch
            .iter()
            .filter(|s| s.sched.sample)
            .map(|s| Sampled {
                id: s.sched.id,
                token: match (s.params.pooling, s.allowed) {
                    (true, _) => self.eos,
                    (false, Some(mask)) => self.constrained_token(s.params.seed, s.num_output_tokens, mask),
                    (false, None) => self.token_at(s.params.seed, s.num_output_tokens, s.eos_allowed),
                },
                // A timing model has no distribution; the server refuses `logprobs` for it.
                logprobs: None,
            })
            .collect();
        let pooled = batch
            .iter()
            .filter(|s| s.params.pooling)
            .map(|s| (s.sched.id, token_vectors(&s.tokens[s.sched.start..s.sched.start + s.sched.len])))
            .collect();
        Ok(StepOutput { sampled, pooled, model_time: Some(step_time(&self.profile, &shape)) })
    }
}

/// Width of the simulator's embeddings.
pub const SIM_EMBEDDING_DIM: usize = 256;

/// The simulator's stand-in for hidden states: the sum of a fixed pseudo-random vector per
/// token id, so texts sharing tokens get close embeddings (a bag of tokens).
fn token_vectors(tokens: &[TokenId]) -> Vec<f32> {
    let mut sum = vec![0f32; SIM_EMBEDDING_DIM];
    for &t in tokens {
        for (j, v) in sum.iter_mut().enumerate() {
            let r = splitmix64(u64::from(t) << 16 | j as u64);
            *v += (r >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        }
    }
    sum
}

/// SplitMix64 finalizer: a cheap, well-mixed 64-bit hash.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}
