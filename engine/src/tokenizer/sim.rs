//! The simulator's tokenizer: [`SimTokenizer`], deterministic and cheap and yet counting
//! roughly like a real BPE tokenizer (about 1.3 tokens per English word):
//!
//! * a token is a run of at most 4 ASCII letters or digits, together with the single
//!   space before it when there is one (`" hello"` → `" hell"`, `"o"`);
//! * any other character (punctuation, newline, a non-ASCII character) is a token of its own.
//!
//! Ids: `0` is end-of-sequence, `1..=WORDS.len()` are the words the simulator generates
//! (so generated text re-tokenizes to the same ids, and multi-turn prefixes hit the cache),
//! `BYTE_BASE..BYTE_BASE + 256` are single bytes (what constrained decoding spells JSON
//! with; a prompt's ASCII punctuation uses them too), everything else is a 32-bit hash of
//! the piece above [`SimTokenizer::HASH_BASE`]. Hashed ids do not decode back to text; the
//! simulator never generates them.

use std::collections::HashMap;

use super::{TokenId, Tokenizer};

/// Words the simulator generates; each is one token with a leading space.
pub const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were", "their",
    "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "she", "other", "its", "may", "these", "what", "them", "than", "some", "him", "time", "into", "only", "do", "like",
    "then", "our", "any", "new", "also", "two", "way", "each", "made", "out", "many", "work", "well", "long", "part",
    "day", "year", "good", "over", "such", "most", "used", "make", "much", "same", "very", "both", "find", "here",
    "came", "go", "want", "home", "read", "hand", "port", "big", "even", "land", "near", "line", "turn", "move",
    "live", "old", "back", "give", "just", "name", "great", "form", "help", "low", "end", "does", "tell", "set",
    "three", "air", "play", "small", "put", "spell", "add", "stone", "must", "high", "act", "why", "ask", "men",
    "went", "light", "kind", "off", "need", "house", "try", "us", "again", "point", "page", "world", "sun", "four",
    "next", "open", "seem", "tree", "city", "earth", "eye", "keep", "last", "let", "never", "plan", "road", "sea",
    "start", "story", "far", "draw", "left", "late", "run", "while", "press", "close", "night", "real", "life", "few",
    "north", "book", "carry", "took", "rock", "room", "river", "fact", "idea", "fish", "care", "face", "bird", "soon",
    "mile", "wind", "ship", "area", "half", "red", "list", "song", "rest", "step", "early", "hold", "west", "green",
    "oh", "quick", "gold",
];

/// The simulator's tokenizer. See the module documentation.
#[derive(Debug, Clone)]
pub struct SimTokenizer {
    word_ids: HashMap<&'static str, TokenId>,
}

impl Default for SimTokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl SimTokenizer {
    /// Ids at or above this are hashes of prompt pieces.
    pub const HASH_BASE: TokenId = 1 << 16;
    /// End of sequence.
    pub const EOS: TokenId = 0;
    /// Id of byte 0; bytes are `BYTE_BASE..BYTE_BASE + 256`.
    pub const BYTE_BASE: TokenId = 1024;

    /// Build the word table.
    pub fn new() -> Self {
        let mut word_ids = HashMap::new();
        for (i, w) in WORDS.iter().enumerate() {
            word_ids.entry(*w).or_insert(i as TokenId + 1);
        }
        SimTokenizer { word_ids }
    }

    /// Id of the `i`-th generated word (`i` taken modulo the table size).
    pub fn word_token(&self, i: u64) -> TokenId {
        (i % WORDS.len() as u64) as TokenId + 1
    }

    fn piece_id(&self, piece: &str) -> TokenId {
        if let [b] = piece.as_bytes() {
            if !b.is_ascii_alphanumeric() {
                return Self::BYTE_BASE + TokenId::from(*b);
            }
        }
        let bare = piece.strip_prefix(' ').unwrap_or(piece);
        if piece.starts_with(' ') {
            if let Some(&id) = self.word_ids.get(bare) {
                return id;
            }
        }
        let h = xxhash_rust::xxh3::xxh3_64(piece.as_bytes());
        Self::HASH_BASE + (h % (u32::MAX - Self::HASH_BASE) as u64) as TokenId
    }
}

impl Tokenizer for SimTokenizer {
    fn encode(&self, text: &str) -> Vec<TokenId> {
        let bytes = text.as_bytes();
        let mut out = Vec::with_capacity(text.len() / 4 + 1);
        let mut i = 0;
        while i < bytes.len() {
            let start = i;
            if bytes[i] == b' ' && i + 1 < bytes.len() && bytes[i + 1].is_ascii_alphanumeric() {
                i += 1;
            }
            if bytes[i].is_ascii_alphanumeric() {
                let run_start = i;
                let mut run_end = i;
                while run_end < bytes.len() && bytes[run_end].is_ascii_alphanumeric() {
                    run_end += 1;
                }
                // a whole generated word stays one token, whatever its length
                if start < run_start && self.word_ids.contains_key(&text[run_start..run_end]) {
                    i = run_end;
                } else {
                    i = (run_start + 4).min(run_end);
                }
            } else {
                // one whole character (UTF-8 aware)
                let ch_len = text[i..].chars().next().map_or(1, char::len_utf8);
                i += ch_len;
            }
            out.push(self.piece_id(&text[start..i]));
        }
        out
    }

    fn decode(&self, ids: &[TokenId]) -> String {
        let mut s = Vec::new();
        for &id in ids {
            match id {
                Self::EOS => {}
                id if (id as usize) <= WORDS.len() => {
                    s.push(b' ');
                    s.extend_from_slice(WORDS[id as usize - 1].as_bytes());
                }
                id if (Self::BYTE_BASE..Self::BYTE_BASE + 256).contains(&id) => s.push((id - Self::BYTE_BASE) as u8),
                _ => s.extend_from_slice("\u{FFFD}".as_bytes()),
            }
        }
        String::from_utf8_lossy(&s).into_owned()
    }

    fn token_bytes(&self) -> Vec<Vec<u8>> {
        let mut bytes = vec![Vec::new(); Self::BYTE_BASE as usize + 256];
        bytes[Self::EOS as usize] = b"\xFF<eos>".to_vec();
        for (i, w) in WORDS.iter().enumerate() {
            bytes[i + 1] = format!(" {w}").into_bytes();
        }
        for b in 0..=255u8 {
            bytes[(Self::BYTE_BASE + TokenId::from(b)) as usize] = vec![b];
        }
        bytes
    }

    fn eos_token_id(&self) -> TokenId {
        Self::EOS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_like_bpe_and_is_deterministic() {
        let t = SimTokenizer::new();
        let ids = t.encode("Hello zebras, my quirky fox.");
        // "Hell" "o" " zebr" "as" "," " my" " quir" "ky" " fox" "."
        assert_eq!(ids.len(), 10);
        assert_eq!(ids, t.encode("Hello zebras, my quirky fox."));
        // generated words are single tokens whatever their length
        assert_eq!(t.encode(" world").len(), 1);
        assert!(t.encode("héllo ✓").len() >= 4, "non-ASCII characters are single tokens");
    }

    #[test]
    fn ascii_punctuation_is_byte_tokens_that_round_trip() {
        let t = SimTokenizer::new();
        assert_eq!(t.encode("{"), vec![SimTokenizer::BYTE_BASE + u32::from(b'{')]);
        assert_eq!(t.decode(&t.encode("{\": [ ]}")), "{\": [ ]}");
        let bytes = t.token_bytes();
        assert_eq!(bytes[t.encode(" the")[0] as usize], b" the");
        assert_eq!(bytes[t.encode("{")[0] as usize], b"{");
    }

    #[test]
    fn word_table_has_no_duplicates() {
        let set: std::collections::HashSet<_> = WORDS.iter().collect();
        assert_eq!(set.len(), WORDS.len());
    }

    #[test]
    fn generated_words_round_trip() {
        let t = SimTokenizer::new();
        let ids: Vec<_> = (0..WORDS.len() as u64).map(|i| t.word_token(i)).collect();
        let text = t.decode(&ids);
        assert_eq!(t.encode(&text), ids);
    }
}
