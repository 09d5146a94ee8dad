//! Tokenizing a prompt piece by piece, with the pieces that repeat (a shared system prompt, a
//! conversation's earlier turns) remembered.
//!
//! A `tokenizers` tokenizer first cuts the text at its added tokens (`<|im_start|>`, …:
//! leftmost-longest matches on the raw text) and tokenizes each piece between them on its
//! own, so a rendered chat's token ids are the concatenation of its pieces' ids and the
//! added tokens'. [`PieceSplitter`] makes the same cut; [`PieceCache`] keeps the ids of long
//! pieces by a 128-bit hash of their text, within a byte bound (least recently used first).
//!
//! The cut is only made when every added token matches plainly (no `single_word`, `lstrip`,
//! `rstrip` or `normalized` token, whose matching depends on the neighbours); otherwise the
//! text is tokenized whole. And the cache checks itself: the first [`CHECKED_FIRST`] results,
//! and one in [`CHECK_EVERY`] after, are compared with the whole-text tokenization, and a
//! single difference (a pre-tokenizer that treats a text's first piece specially, say) turns
//! piecewise tokenization off for good.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use parking_lot::Mutex;

use crate::TokenId;

/// Results compared with the whole-text tokenization before the cache is trusted.
pub const CHECKED_FIRST: u64 = 32;
/// After those, one result in this many is compared.
pub const CHECK_EVERY: u64 = 1024;
/// Pieces shorter than this (bytes) are tokenized every time: cheap, and rarely repeated.
pub const MIN_CACHED_BYTES: usize = 64;

/// Cuts text at a tokenizer's added tokens, as the tokenizer does.
#[derive(Debug, Clone)]
pub struct PieceSplitter {
    matcher: AhoCorasick,
    ids: Vec<TokenId>,
}

/// A piece of text: tokenized on its own, or an added token's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Text between added tokens.
    Text(&'a str),
    /// An added token.
    Added(TokenId),
}

impl PieceSplitter {
    /// A splitter for `added` (content, id, whether it matches plainly), or `None` when one
    /// of them does not match plainly (the text must then be tokenized whole).
    pub fn new(added: impl IntoIterator<Item = (String, TokenId, bool)>) -> Option<PieceSplitter> {
        let mut patterns = Vec::new();
        let mut ids = Vec::new();
        for (content, id, plain) in added {
            if !plain {
                return None;
            }
            patterns.push(content);
            ids.push(id);
        }
        let matcher = AhoCorasickBuilder::new().match_kind(MatchKind::LeftmostLongest).build(&patterns).ok()?;
        Some(PieceSplitter { matcher, ids })
    }

    /// The pieces of `text`, in order.
    pub fn split<'a>(&self, text: &'a str) -> Vec<Piece<'a>> {
        let mut out = Vec::new();
        let mut at = 0;
        for m in self.matcher.find_iter(text) {
            if m.start() > at {
                out.push(Piece::Text(&text[at..m.start()]));
            }
            out.push(Piece::Added(self.ids[m.pattern().as_usize()]));
            at = m.end();
        }
        if at < text.len() {
            out.push(Piece::Text(&text[at..]));
        }
        out
    }
}

/// Remembered token ids of long pieces. See the module documentation.
#[derive(Debug)]
pub struct PieceCache {
    max_bytes: usize,
    entries: Mutex<Entries>,
    calls: AtomicU64,
    off: AtomicBool,
    hits: AtomicU64,
    misses: AtomicU64,
}

#[derive(Debug)]
struct Entries {
    map: lru::LruCache<u128, Arc<[TokenId]>>,
    bytes: usize,
}

/// Bytes one entry is charged beyond its ids: key, `Arc` header, map slot and list links.
const ENTRY_OVERHEAD: usize = 96;

impl PieceCache {
    /// An empty cache holding at most `max_bytes` of ids.
    pub fn new(max_bytes: usize) -> PieceCache {
        PieceCache {
            max_bytes,
            entries: Mutex::new(Entries { map: lru::LruCache::unbounded(), bytes: 0 }),
            calls: AtomicU64::new(0),
            off: AtomicBool::new(false),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Whether piecewise tokenization was found to differ and turned off.
    pub fn is_off(&self) -> bool {
        self.off.load(Ordering::Relaxed)
    }

    /// (hits, misses) of long pieces so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.hits.load(Ordering::Relaxed), self.misses.load(Ordering::Relaxed))
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.entries.lock().bytes
    }

    /// Whether this call's result is to be checked against the whole-text tokenization.
    pub(crate) fn check_now(&self) -> bool {
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        n < CHECKED_FIRST || n.is_multiple_of(CHECK_EVERY)
    }

    pub(crate) fn turn_off(&self) {
        self.off.store(true, Ordering::Relaxed);
        let mut e = self.entries.lock();
        e.map.clear();
        e.bytes = 0;
    }

    /// The ids of `piece`, from the cache or from `encode` (then kept).
    pub(crate) fn get_or_encode(&self, piece: &str, encode: impl FnOnce(&str) -> Vec<TokenId>) -> Arc<[TokenId]> {
        let key = xxhash_rust::xxh3::xxh3_128(piece.as_bytes());
        if let Some(ids) = self.entries.lock().map.get(&key) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return ids.clone();
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let ids: Arc<[TokenId]> = encode(piece).into();
        let cost = ids.len() * std::mem::size_of::<TokenId>() + ENTRY_OVERHEAD;
        if cost <= self.max_bytes {
            let mut e = self.entries.lock();
            if e.map.put(key, ids.clone()).is_none() {
                e.bytes += cost;
            }
            while e.bytes > self.max_bytes {
                let Some((_, old)) = e.map.pop_lru() else { break };
                e.bytes -= old.len() * std::mem::size_of::<TokenId>() + ENTRY_OVERHEAD;
            }
        }
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_cut_at_the_longest_added_token_first() {
        let s = PieceSplitter::new([("<a>".to_string(), 1, true), ("<a><b>".to_string(), 2, true)]).unwrap();
        assert_eq!(s.split("x<a><b>y<a>"), vec![Piece::Text("x"), Piece::Added(2), Piece::Text("y"), Piece::Added(1)]);
        assert_eq!(s.split(""), vec![]);
        assert!(PieceSplitter::new([("<a>".to_string(), 1, true), ("<b>".to_string(), 2, false)]).is_none());
    }

    #[test]
    fn the_cache_keeps_what_fits_and_drops_the_least_recently_used() {
        let c = PieceCache::new(3 * (ENTRY_OVERHEAD + 40));
        let enc = |s: &str| vec![s.len() as u32; 10];
        for p in ["a", "b", "c"] {
            c.get_or_encode(p, enc);
        }
        c.get_or_encode("a", |_| unreachable!("a is cached"));
        c.get_or_encode("d", enc); // evicts b, the least recently used
        assert_eq!(c.counts(), (1, 4));
        c.get_or_encode("a", |_| unreachable!("a stays"));
        let mut again = false;
        c.get_or_encode("b", |s| {
            again = true;
            enc(s)
        });
        assert!(again, "b was evicted");
        assert!(c.bytes() <= 3 * (ENTRY_OVERHEAD + 40));
    }
}
