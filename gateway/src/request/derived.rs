//! The routing fields as serde's derived `Deserialize` reads them, with the prompt's items
//! counted by a visitor of their own, skipping everything else unchecked. The one-pass
//! reader ([`super::routing_fields`], built on the canonical prompt's visitor) gives way to
//! it whenever it fails: a number out of `f64`'s range (`1e400`) is valid JSON the prompt
//! visitor cannot read, and the error a client gets is this reader's. A unit test checks
//! the two agree on random bodies.

use std::fmt;

use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{checked_fields, PromptLimits, RoutingFields};
use crate::error::ProxyError;

/// The routing fields of `text` (a body checked by [`super::json_text`]) read by serde's
/// derived `Deserialize`, the prompt's items counted apart.
pub(super) fn routing_fields(text: &str, limits: &PromptLimits) -> Result<RoutingFields, ProxyError> {
    #[derive(Deserialize)]
    struct Raw<'a> {
        #[serde(borrow)]
        model: Option<&'a RawValue>,
        #[serde(borrow)]
        stream: Option<&'a RawValue>,
        #[serde(borrow)]
        max_tokens: Option<&'a RawValue>,
        #[serde(borrow)]
        max_completion_tokens: Option<&'a RawValue>,
        #[serde(borrow)]
        n: Option<&'a RawValue>,
        messages: Option<Items>,
        prompt: Option<Items>,
    }
    let raw: Raw<'_> = serde_json::from_str(text)
        .map_err(|e| ProxyError::BadRequest(format!("request body is not valid JSON: {e}")))?;
    if let Some(Items { top, .. }) = raw.messages {
        if top > limits.max_messages {
            return Err(ProxyError::too_long("messages", "an array", limits.max_messages, top));
        }
    }
    if let Some(Items { all, .. }) = raw.prompt {
        if all > limits.max_prompt_items {
            return Err(ProxyError::too_long("prompt", "prompts or token ids", limits.max_prompt_items, all));
        }
    }
    checked_fields(text, raw.model, raw.stream, [raw.max_tokens, raw.max_completion_tokens, raw.n])
}

/// How many items a value holds, counted while it is skipped: `top`, the entries of an
/// array (0 for anything else); `all`, those entries with each nested array counted by its
/// own entries (`[[1,2],[3]]`: top 2, all 3).
struct Items {
    array: bool,
    top: usize,
    all: usize,
}

/// A value that is not an array: one item of its parent.
const ONE: Items = Items { array: false, top: 0, all: 1 };

impl<'de> Deserialize<'de> for Items {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(CountItems { nested: true })
    }
}

/// Counts an array's entries (and, when `nested`, those of the arrays in it); any other
/// value is skipped and counts as one item of its parent.
struct CountItems {
    nested: bool,
}

impl<'de> serde::de::DeserializeSeed<'de> for CountItems {
    type Value = Items;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Items, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CountItems {
    type Value = Items;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Items, A::Error> {
        let (mut top, mut all) = (0usize, 0usize);
        if self.nested {
            while let Some(inner) = seq.next_element_seed(CountItems { nested: false })? {
                top += 1;
                all = all.saturating_add(if inner.array { inner.top } else { 1 });
            }
        } else {
            while seq.next_element::<IgnoredAny>()?.is_some() {
                top += 1;
            }
            all = top;
        }
        Ok(Items { array: true, top, all })
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Items, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(ONE)
    }
    fn visit_str<E>(self, _: &str) -> Result<Items, E> {
        Ok(ONE)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Items, E> {
        Ok(ONE)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Items, E> {
        Ok(ONE)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Items, E> {
        Ok(ONE)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Items, E> {
        Ok(ONE)
    }
    fn visit_unit<E>(self) -> Result<Items, E> {
        Ok(ONE)
    }
}
