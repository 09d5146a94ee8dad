//! Every token's bytes: what a grammar engine needs to know which tokens can continue a
//! text (constrained decoding matches grammars against bytes, not ids).
//!
//! Byte-level BPE vocabularies (GPT-2's scheme: every byte is written as a printable
//! character, `Ġ` for a space) are mapped back through that table; SentencePiece-style
//! ones through their `<0xNN>` byte tokens and `▁` for a space. Special tokens come back
//! as [`SPECIAL_MARKER`] followed by their text, so no grammar over text can produce them.

use std::collections::HashMap;

/// First byte of a special token's entry (0xFF never occurs in UTF-8 text).
pub const SPECIAL_MARKER: u8 = 0xFF;

/// How a vocabulary writes bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// GPT-2's byte-to-character table.
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xNN>` a raw byte.
    Metaspace,
}

/// GPT-2's table: the printable Latin-1 bytes stand for themselves, the 68 others are
/// shifted to U+0100 and up, in byte order. Indexed by byte.
pub(crate) fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut shifted = 0u32;
    for (b, c) in (0..=255u8).zip(chars.iter_mut()) {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        *c = if printable {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).expect("U+0100..U+0143 are chars")
        };
    }
    chars
}

/// [`byte_chars`] the other way: character → byte.
fn byte_level_table() -> HashMap<char, u8> {
    (0..=255u8).zip(byte_chars()).map(|(b, c)| (c, b)).collect()
}

/// The bytes of one vocabulary entry written in `scheme`; `None` when the entry holds a
/// character the scheme cannot write (a malformed vocabulary).
pub fn entry_bytes(scheme: Scheme, entry: &str, table: &HashMap<char, u8>) -> Option<Vec<u8>> {
    match scheme {
        Scheme::ByteLevel => entry.chars().map(|c| table.get(&c).copied()).collect(),
        Scheme::Metaspace => {
            if let Some(hex) = entry.strip_prefix("<0x").and_then(|s| s.strip_suffix('>')) {
                if let Ok(b) = u8::from_str_radix(hex, 16) {
                    return Some(vec![b]);
                }
            }
            Some(entry.replace('\u{2581}', " ").into_bytes())
        }
    }
}

/// The bytes of every id below `len`: `entry(id)` gives the vocabulary's string for an id,
/// `added(id)` whether it is an added token and, if so, whether it is special.
pub fn token_bytes(
    len: usize,
    scheme: Scheme,
    entry: impl Fn(u32) -> Option<String>,
    added: impl Fn(u32) -> Option<bool>,
) -> Vec<Vec<u8>> {
    let table = byte_level_table();
    (0..len as u32)
        .map(|id| {
            let Some(text) = entry(id) else { return Vec::new() };
            match added(id) {
                Some(true) => [&[SPECIAL_MARKER][..], text.as_bytes()].concat(),
                Some(false) => text.into_bytes(),
                None => entry_bytes(scheme, &text, &table).unwrap_or_default(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_level_table_is_gpt2s() {
        let t = byte_level_table();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'Ġ'], b' ');
        assert_eq!(t[&'Ċ'], b'\n');
        assert_eq!(t[&'a'], b'a');
        assert_eq!(t[&'\u{100}'], 0);
        assert_eq!(entry_bytes(Scheme::ByteLevel, "Ġhello", &t).unwrap(), b" hello");
        assert_eq!(entry_bytes(Scheme::ByteLevel, "Ã©", &t).unwrap(), "é".as_bytes());
    }

    #[test]
    fn sentencepiece_entries_map_spaces_and_bytes() {
        let t = byte_level_table();
        assert_eq!(entry_bytes(Scheme::Metaspace, "▁the", &t).unwrap(), b" the");
        assert_eq!(entry_bytes(Scheme::Metaspace, "<0x0A>", &t).unwrap(), b"\n");
    }
}
