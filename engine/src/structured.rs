//! Structured output: constrained decoding with a grammar engine.
//!
//! A request that asks for JSON (`response_format`), a regex, a choice or a grammar gets a
//! [`Constraint`]: an `llguidance` matcher compiled from its [`GuidedSpec`] against the
//! model's vocabulary. Before each step that samples for the request, the scheduler asks the
//! constraint for the set of tokens that keep the output inside the grammar
//! ([`Constraint::prepare`]); the backend samples among those only; the sampled token is
//! then fed back ([`Constraint::accept`]). When the grammar is complete the request ends —
//! the output always parses, unless `max_tokens` cut it first (`finish_reason: length`).
//!
//! [`Grammars`] holds what is shared by every request of a model (the token trie, the
//! lexer's precomputed slices); compiling a spec is per request and happens in the HTTP
//! handler, so a schema the engine cannot compile is a 400 before anything is queued.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::tokenizer::{TokenId, Tokenizer};

/// What the output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum GuidedSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against a JSON Schema (`json_schema`, `guided_json`).
    JsonSchema(Value),
    /// Text matching a regular expression (`guided_regex`).
    Regex(String),
    /// Exactly one of these strings (`guided_choice`).
    Choice(Vec<String>),
    /// A Lark grammar (`guided_grammar`; llguidance's Lark dialect).
    Grammar(String),
}

impl GuidedSpec {
    /// The llguidance grammar for this spec. JSON is compact (no whitespace between
    /// tokens) unless the schema's own `x-guidance` says otherwise: a model cannot then
    /// spend its tokens on spaces.
    fn grammar(&self) -> TopLevelGrammar {
        let compact = |mut schema: Value| {
            if let Some(obj) = schema.as_object_mut() {
                obj.entry("x-guidance").or_insert(json!({"whitespace_flexible": false}));
            }
            schema
        };
        match self {
            GuidedSpec::JsonObject => TopLevelGrammar::from_json_schema(compact(json!({"type": "object"}))),
            GuidedSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema.clone())),
            GuidedSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GuidedSpec::Choice(choices) => {
                let alternatives: Vec<String> = choices.iter().map(|c| escape_regex(c)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
            GuidedSpec::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// `text` as a regex matching exactly itself.
fn escape_regex(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The model's vocabulary as llguidance sees it: a trie over every token's bytes, and the
/// tokenizer for the (rare) text it needs tokenized.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Arc<dyn Tokenizer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokenizer's ids, or the trie's greedy spelling when the tokenizer gives ids
    /// outside the vocabulary (the simulator's hashed prompt pieces).
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let ids = self.tokenizer.encode(&String::from_utf8_lossy(s));
        if ids.iter().all(|&id| id < self.trie.vocab_size() as TokenId) {
            return ids;
        }
        self.trie.greedy_tokenize(s)
    }
}

/// Grammar compilation for one model.
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("vocab_size", &self.factory.tok_env().tok_trie().vocab_size()).finish()
    }
}

impl Grammars {
    /// Build the shared state over `tokenizer`'s vocabulary (tens of milliseconds for a
    /// 50k-token vocabulary; once per engine).
    pub fn new(tokenizer: Arc<dyn Tokenizer>) -> Result<Self, String> {
        let words = tokenizer.token_bytes();
        let info = TokRxInfo::new(words.len() as u32, tokenizer.eos_token_id());
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// Compile `spec` for one request. The error says what the grammar engine rejected.
    pub fn compile(&self, spec: &GuidedSpec) -> Result<Constraint, String> {
        if let GuidedSpec::Choice(c) = spec {
            if c.is_empty() || c.iter().any(String::is_empty) {
                return Err("the choices must be a non-empty list of non-empty strings".into());
            }
        }
        let parser = self.factory.create_parser(spec.grammar()).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint { matcher, mask: None })
    }
}

/// One request's grammar state.
pub struct Constraint {
    matcher: Matcher,
    /// The tokens allowed at the next sampling step ([`Self::prepare`]).
    mask: Option<SimpleVob>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

impl Clone for Constraint {
    /// A fresh copy for another choice of the same request (`n` > 1).
    fn clone(&self) -> Self {
        Constraint { matcher: self.matcher.deep_clone(), mask: None }
    }
}

impl Constraint {
    /// Compute the tokens allowed next. A grammar that has failed allows only EOS.
    pub fn prepare(&mut self) {
        let mask = match self.matcher.compute_mask_or_eos() {
            Ok(mask) => mask,
            Err(e) => {
                tracing::warn!(error = %e, "grammar failed; ending the request");
                let trie = self.matcher.tok_env().map(|env| env.tok_trie().eos_token_set());
                trie.unwrap_or_default()
            }
        };
        self.mask = Some(mask);
    }

    /// The tokens allowed at this step (after [`Self::prepare`]).
    pub fn mask(&self) -> Option<&SimpleVob> {
        self.mask.as_ref()
    }

    /// Feed the sampled token. Returns true when the grammar is complete (or has failed):
    /// the request ends.
    pub fn accept(&mut self, token: TokenId) -> bool {
        self.mask = None;
        if let Err(e) = self.matcher.consume_token(token) {
            tracing::warn!(error = %e, token, "grammar rejected a token; ending the request");
            return true;
        }
        self.matcher.is_stopped()
    }
}

/// Keep only `mask`'s tokens in `logits` (the rest become −∞; ids past the mask too).
pub fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) {
    for (i, l) in logits.iter_mut().enumerate() {
        if i >= mask.len() || !mask.is_allowed(i as TokenId) {
            *l = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::SimTokenizer;

    /// Drive a constraint by always taking the allowed token `pick` chooses.
    fn run(c: &mut Constraint, tok: &dyn Tokenizer, mut pick: impl FnMut(&SimpleVob) -> TokenId) -> String {
        let mut out = Vec::new();
        for _ in 0..400 {
            c.prepare();
            let t = pick(c.mask().unwrap());
            out.push(t);
            if c.accept(t) {
                break;
            }
        }
        tok.decode(&out)
    }

    #[test]
    fn the_sim_vocabulary_spells_valid_json_under_a_schema() {
        let tok: Arc<dyn Tokenizer> = Arc::new(SimTokenizer::new());
        let g = Grammars::new(tok.clone()).unwrap();
        let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": false});
        let mut c = g.compile(&GuidedSpec::JsonSchema(schema)).unwrap();
        // The highest allowed id: words while a string is open, then its end.
        let text = run(&mut c, tok.as_ref(), |m| m.to_list().into_iter().max().unwrap());
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["name"].is_string() && v["age"].is_i64(), "{v}");
    }

    #[test]
    fn choices_and_regexes_allow_only_their_strings() {
        let tok: Arc<dyn Tokenizer> = Arc::new(SimTokenizer::new());
        let g = Grammars::new(tok.clone()).unwrap();
        let mut c = g.compile(&GuidedSpec::Choice(vec!["yes (sure)".into(), "no".into()])).unwrap();
        let text = run(&mut c, tok.as_ref(), |m| m.to_list()[0]);
        assert!(text == "yes (sure)" || text == "no", "{text:?}");
        let mut c = g.compile(&GuidedSpec::Regex("[0-9]{3}-x".into())).unwrap();
        let text = run(&mut c, tok.as_ref(), |m| m.to_list().into_iter().max().unwrap());
        assert_eq!(text.len(), 5);
        assert!(text.ends_with("-x") && text[..3].chars().all(|c| c.is_ascii_digit()), "{text:?}");
    }

    #[test]
    fn bad_grammars_are_errors() {
        let g = Grammars::new(Arc::new(SimTokenizer::new())).unwrap();
        assert!(g.compile(&GuidedSpec::JsonSchema(json!({"type": "nonsense"}))).is_err());
        assert!(g.compile(&GuidedSpec::Regex("(unclosed".into())).is_err());
        assert!(g.compile(&GuidedSpec::Choice(vec![])).is_err());
        assert!(g.compile(&GuidedSpec::Grammar("start: ???".into())).is_err());
    }
}
