//! GPT-2's pre-tokenizer split (byte-level BPE: GPT-2, SmolLM), as one forward scan.
//!
//! `tokenizers` cuts text before BPE with the regex
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, which needs
//! fancy-regex's backtracking VM for the look-ahead, then keeps offsets for every piece:
//! ~1,200 instructions per byte, more than the rest of a proxied request for a short prompt
//! (`SWITCHYARD_BENCH_KV_EVENTS=1 loadtest/bench/profile_gateway.sh`). The alternatives never
//! need more than one character of look-ahead, so a scan gives the same pieces:
//!
//! - `'` followed by `s`, `t`, `re`, `ve`, `m`, `ll` or `d` is a piece (case-sensitive);
//! - else an optional ASCII space and a run of letters, of numbers, or of anything that is
//!   neither letter, number nor white space;
//! - else a run of white space, minus its last character when a non-space follows and the
//!   run has more than one (that character then starts the next piece: `" word"`).
//!
//! Letters and numbers are the regex crate's `\p{L}` and `\p{N}` tables (what fancy-regex
//! matches with), white space is `White_Space` like its `\s`. SmolLM's `Digits`
//! pre-tokenizer (`individual_digits`) first isolates every `char::is_numeric` character,
//! as `tokenizers` does. Checked against `tokenizers`' own pre-tokenizers on random text
//! (`tests`), and at run time against whole-text tokenization (see `ModelTokenizer::encode_cached`).

use std::sync::LazyLock;

use regex_syntax::hir::{Class, HirKind};

/// The split of one model.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gpt2Split {
    /// SmolLM: every numeric character is a piece of its own, before the GPT-2 split.
    pub individual_digits: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Letter,
    Number,
    Space,
    Other,
}

/// Sorted, disjoint ranges of a Unicode class.
struct Ranges(Vec<(char, char)>);

impl Ranges {
    fn of(pattern: &str) -> Ranges {
        let ranges = match regex_syntax::Parser::new().parse(pattern).map(|h| h.into_kind()) {
            Ok(HirKind::Class(Class::Unicode(c))) => c.ranges().iter().map(|r| (r.start(), r.end())).collect(),
            _ => Vec::new(),
        };
        Ranges(ranges)
    }

    fn contains(&self, c: char) -> bool {
        self.0
            .binary_search_by(|&(lo, hi)| {
                if hi < c {
                    std::cmp::Ordering::Less
                } else if lo > c {
                    std::cmp::Ordering::Greater
                } else {
                    std::cmp::Ordering::Equal
                }
            })
            .is_ok()
    }
}

static LETTERS: LazyLock<Ranges> = LazyLock::new(|| Ranges::of(r"\p{L}"));
static NUMBERS: LazyLock<Ranges> = LazyLock::new(|| Ranges::of(r"\p{N}"));

/// Whether the Unicode tables loaded (they are the regex crate's, compiled in).
pub(crate) fn available() -> bool {
    !LETTERS.0.is_empty() && !NUMBERS.0.is_empty()
}

/// The kind of each ASCII character (the regex's `\p{L}`, `\p{N}` and `\s` on ASCII).
const ASCII_KINDS: [Kind; 128] = {
    let mut kinds = [Kind::Other; 128];
    let mut b = 0;
    while b < 128 {
        kinds[b] = match b as u8 {
            b'a'..=b'z' | b'A'..=b'Z' => Kind::Letter,
            b'0'..=b'9' => Kind::Number,
            b'\t' | b'\n' | b'\x0B' | b'\x0C' | b'\r' | b' ' => Kind::Space,
            _ => Kind::Other,
        };
        b += 1;
    }
    kinds
};

fn kind(c: char) -> Kind {
    if c.is_ascii() {
        return ASCII_KINDS[c as usize];
    }
    if c.is_whitespace() {
        Kind::Space
    } else if LETTERS.contains(c) {
        Kind::Letter
    } else if NUMBERS.contains(c) {
        Kind::Number
    } else {
        Kind::Other
    }
}

/// The character starting at byte `i` of `text` (a character boundary) and its kind: ASCII
/// from the table, without decoding.
#[inline]
fn char_at(text: &str, i: usize) -> (char, Kind) {
    let b = text.as_bytes()[i];
    if b.is_ascii() {
        return (char::from(b), ASCII_KINDS[usize::from(b)]);
    }
    let c = text[i..].chars().next().unwrap_or(char::REPLACEMENT_CHARACTER);
    (c, kind(c))
}

impl Gpt2Split {
    /// Call `piece` with each piece of `text`, in order; together they are `text`.
    pub fn split<'a>(&self, text: &'a str, piece: &mut impl FnMut(&'a str)) {
        if !self.individual_digits {
            return split_gpt2(text, piece);
        }
        let (bytes, mut start, mut i) = (text.as_bytes(), 0, 0);
        while i < bytes.len() {
            let (numeric, len) = if bytes[i].is_ascii() {
                (bytes[i].is_ascii_digit(), 1)
            } else {
                let c = text[i..].chars().next().unwrap_or(char::REPLACEMENT_CHARACTER);
                (c.is_numeric(), c.len_utf8())
            };
            if numeric {
                split_gpt2(&text[start..i], piece);
                piece(&text[i..i + len]);
                start = i + len;
            }
            i += len;
        }
        split_gpt2(&text[start..], piece);
    }
}

fn split_gpt2<'a>(text: &'a str, piece: &mut impl FnMut(&'a str)) {
    let mut at = 0;
    while at < text.len() {
        let end = piece_end(text, at);
        piece(&text[at..end]);
        at = end;
    }
}

/// Where the piece starting at `at` ends (`at < text.len()`).
fn piece_end(text: &str, at: usize) -> usize {
    let bytes = text.as_bytes();
    if bytes[at] == b'\'' {
        let after = &bytes[at + 1..];
        if let Some(c) = ["s", "t", "re", "ve", "m", "ll", "d"].iter().find(|c| after.starts_with(c.as_bytes())) {
            return at + 1 + c.len();
        }
    }
    // An optional space, then a run of one kind other than white space.
    let from = if bytes[at] == b' ' { at + 1 } else { at };
    if from < text.len() {
        let (_, k) = char_at(text, from);
        if k != Kind::Space {
            return run_end(text, from, k);
        }
    }
    // White space (the character at `at` is: a space not followed by a run, or another).
    let mut last = at;
    let mut end = at;
    while end < text.len() {
        let (c, k) = char_at(text, end);
        if k != Kind::Space {
            break;
        }
        last = end;
        end += c.len_utf8();
    }
    // `\s+(?!\S)`: up to the end of text, or all but the last character before a non-space
    // (at least one); else `\s+`: the single character.
    if end == text.len() || last == at {
        end
    } else {
        last
    }
}

/// Where the run of kind `k` starting at `from` ends.
fn run_end(text: &str, from: usize, k: Kind) -> usize {
    let mut i = from;
    while i < text.len() {
        let (c, kc) = char_at(text, i);
        if kc != k {
            return i;
        }
        i += c.len_utf8();
    }
    text.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    /// The pieces `tokenizers` cuts `text` into, as text (its byte-level characters mapped back).
    fn reference(pre: &impl PreTokenizer, text: &str) -> Vec<String> {
        let mut s = PreTokenizedString::from(text);
        pre.pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(_, (start, end), _)| text[start..end].to_string())
            .collect()
    }

    fn ours(split: Gpt2Split, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        split.split(text, &mut |p| out.push(p.to_string()));
        out
    }

    /// Text drawn from characters each alternative of the regex cares about: letters and
    /// numbers of several scripts and categories (Nl, No), marks, every kind of white space,
    /// apostrophes before contraction letters, punctuation, emoji.
    fn random_texts(n: usize) -> Vec<String> {
        const ALPHABET: &[&str] = &[
            "a", "Z", "é", "ß", "Ж", "中", "ー", "\u{301}", "0", "7", "٣", "Ⅻ", "½", "²", " ", " ", " ", "\t", "\n",
            "\r", "\u{A0}", "\u{85}", "\u{2028}", "\u{3000}", "\u{200B}", "'", "'", "s", "t", "re", "ve", "m", "ll",
            "d", "S", "!", ".", ",", "-", "\"", "😀", "✓", "_", "$",
        ];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        (0..n)
            .map(|_| {
                let len = (next() % 24) as usize;
                (0..len).map(|_| ALPHABET[(next() % ALPHABET.len() as u64) as usize]).collect()
            })
            .collect()
    }

    const CASES: &[&str] = &[
        "",
        " ",
        "  ",
        "hello world",
        "hello  world",
        "hello \nworld",
        "it's they're we've I'm you'll he'd 'S",
        " 's",
        "x  ",
        "a\n\n b",
        "\u{A0}a",
        "call 2024, then 12345!",
        "café ✓ 日本語 ½ Ⅻ",
        "!!'s",
        "tab\tend\t",
    ];

    #[test]
    fn pieces_are_words_with_their_space_and_runs_of_one_kind() {
        let gpt2 = Gpt2Split { individual_digits: false };
        assert_eq!(ours(gpt2, "hello  world"), ["hello", " ", " world"]);
        assert_eq!(ours(gpt2, "it's 12!!'s\n"), ["it", "'s", " 12", "!!'", "s", "\n"]);
        assert_eq!(ours(Gpt2Split { individual_digits: true }, "call 2024"), ["call", " ", "2", "0", "2", "4"]);
    }

    #[test]
    fn gpt2s_split_matches_tokenizers_byte_level() {
        assert!(available());
        let pre = ByteLevel::new(false, true, true);
        let split = Gpt2Split { individual_digits: false };
        for text in CASES.iter().map(|s| s.to_string()).chain(random_texts(20_000)) {
            assert_eq!(ours(split, &text), reference(&pre, &text), "{text:?}");
        }
    }

    #[test]
    fn smollms_split_matches_digits_then_byte_level() {
        let pre = Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ]);
        let split = Gpt2Split { individual_digits: true };
        for text in CASES.iter().map(|s| s.to_string()).chain(random_texts(20_000)) {
            assert_eq!(ours(split, &text), reference(&pre, &text), "{text:?}");
        }
    }
}
