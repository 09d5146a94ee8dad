//! Workloads: what each request asks, deterministic per seed and request id.
//!
//! Every target in a run gets the identical request sequence: request `id` is built from
//! `(seed, id)` alone. Text comes from a built-in word list (no downloads); every word is a
//! short, common English word, which real BPE tokenizers and the sim tokenizer both count
//! as about one token, so `--input-len 512` means roughly 512 prompt tokens.
//!
//! | workload | each request |
//! |---|---|
//! | `synthetic` | a prompt of `--input-len` tokens, `--output-len` output tokens |
//! | `shared-prefix` | one of `--groups` long shared system prompts (`--prefix-len`) + a distinct question (`--input-len`) — the case prefix-aware routing exists for |
//! | `multi-turn` | conversations of `--turns` turns re-sending their growing history after `--think-time-s` |
//! | `trace` | replayed from a JSONL file: `{"timestamp": s, "prompt": …}` or `{"messages": […]}`, optional `max_tokens` |
//!
//! Lengths are distributions: `128` or `fixed:128`, `uniform:64:256`, `normal:200:50`,
//! `lognormal:200:100` (mean and standard deviation of the length itself), clamped to ≥ 1.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal, Normal};
use serde::Serialize;

/// A length distribution.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum LengthDist {
    /// Always `n`.
    Fixed {
        /// Length.
        n: u32,
    },
    /// Uniform in `lo..=hi`.
    Uniform {
        /// Minimum.
        lo: u32,
        /// Maximum.
        hi: u32,
    },
    /// Normal with this mean and standard deviation.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// Log-normal whose *values* have this mean and standard deviation.
    LogNormal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
}

impl std::str::FromStr for LengthDist {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let num = |i: usize| -> Result<f64, String> {
            parts
                .get(i)
                .ok_or_else(|| format!("{s:?}: missing parameter"))?
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| format!("{s:?}: {:?} is not a non-negative number", parts[i]))
        };
        let d = match parts[0] {
            "fixed" => LengthDist::Fixed { n: num(1)? as u32 },
            "uniform" => LengthDist::Uniform { lo: num(1)? as u32, hi: num(2)? as u32 },
            "normal" => LengthDist::Normal { mean: num(1)?, std: num(2)? },
            "lognormal" => LengthDist::LogNormal { mean: num(1)?, std: num(2)? },
            _ if parts.len() == 1 => LengthDist::Fixed { n: num(0)? as u32 },
            other => return Err(format!("{s:?}: unknown distribution {other:?} (fixed, uniform, normal, lognormal)")),
        };
        match d {
            LengthDist::Fixed { n: 0 } => Err(format!("{s:?}: length must be >= 1")),
            LengthDist::Uniform { lo, hi } if lo > hi || hi == 0 => Err(format!("{s:?}: need 1 <= lo <= hi")),
            LengthDist::LogNormal { mean, .. } if mean <= 0.0 => Err(format!("{s:?}: mean must be > 0")),
            d => Ok(d),
        }
    }
}

impl LengthDist {
    /// Draw a length (≥ 1).
    pub fn sample(&self, rng: &mut StdRng) -> u32 {
        let v = match *self {
            LengthDist::Fixed { n } => f64::from(n),
            LengthDist::Uniform { lo, hi } => f64::from(rng.random_range(lo..=hi)),
            LengthDist::Normal { mean, std } => Normal::new(mean, std).map_or(mean, |d| d.sample(rng)),
            LengthDist::LogNormal { mean, std } => {
                // parameters of the underlying normal from the mean/std of the values
                let sigma2 = (1.0 + (std / mean).powi(2)).ln();
                let mu = mean.ln() - sigma2 / 2.0;
                LogNormal::new(mu, sigma2.sqrt()).map_or(mean, |d| d.sample(rng))
            }
        };
        v.round().clamp(1.0, 1e7) as u32
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// Role.
    pub role: String,
    /// Content.
    pub content: String,
}

/// A prompt: chat messages (the completions endpoint gets them joined).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    /// Request id.
    pub id: u64,
    /// Messages.
    pub messages: Vec<Message>,
    /// Output tokens asked for.
    pub max_tokens: u32,
    /// Trace arrival time, seconds from the start.
    pub at_s: Option<f64>,
}

impl RequestSpec {
    /// The prompt as one text (completions endpoint): contents joined by blank lines.
    pub fn prompt_text(&self) -> String {
        self.messages.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n\n")
    }
}

/// Short common words: about one token each in BPE vocabularies.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "but", "have", "an", "had", "they", "you", "were", "one", "all", "we",
    "can", "her", "has", "been", "if", "more", "when", "will", "who", "so", "no", "she", "its", "may", "what", "them",
    "than", "some", "him", "time", "into", "only", "do", "like", "then", "any", "new", "also", "two", "way", "each",
    "made", "out", "many", "work", "well", "long", "part", "day", "year", "good", "over", "such", "most", "used",
    "make", "much", "same", "very", "both", "find", "here", "came", "go", "want", "home", "read", "hand", "port",
    "big", "even", "land", "near", "line", "turn", "move", "live", "old", "back", "give", "just", "name", "form",
    "help", "low", "end", "does", "tell", "set", "air", "play", "put", "add", "must", "high", "act", "why", "ask",
    "men", "went", "kind", "off", "need", "try", "us", "page", "sun", "four", "next", "open", "seem", "tree", "city",
    "eye", "keep", "last", "let", "plan", "road", "sea", "far", "draw", "left", "late", "run", "real", "life", "few",
    "book", "took", "rock", "room", "fact", "idea", "fish", "care", "face", "bird", "soon", "mile", "wind", "ship",
    "area", "half", "red", "list", "song", "rest", "step", "hold", "west", "gold", "blue", "tall", "cold", "warm",
];

/// `n` tokens of text: words, with a period every ~12 words.
pub fn text(rng: &mut StdRng, n: u32) -> String {
    let mut s = String::with_capacity(n as usize * 5);
    let mut since_period = 0;
    for i in 0..n {
        if since_period >= 11 && rng.random_range(0..3) == 0 && i + 1 < n {
            s.push('.');
            since_period = 0;
            continue;
        }
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        since_period += 1;
    }
    s
}

/// What kind of workload.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Independent random prompts.
    Synthetic,
    /// Groups sharing a long system prompt.
    SharedPrefix {
        /// Number of groups.
        groups: u32,
        /// Shared prefix length (tokens).
        prefix_len: u32,
    },
    /// Conversations.
    MultiTurn {
        /// Turns per conversation.
        turns: u32,
        /// Pause between a reply and the next turn.
        think_time_s: f64,
    },
    /// Replayed trace.
    Trace {
        /// Requests, in file order.
        #[serde(skip)]
        requests: Vec<RequestSpec>,
        /// Source file.
        path: String,
    },
}

/// A workload: kind, lengths, seed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Workload {
    /// Kind.
    pub kind: WorkloadKind,
    /// Input (question / turn) length.
    pub input: LengthDist,
    /// Output length.
    pub output: LengthDist,
    /// Seed.
    pub seed: u64,
}

fn rng_for(seed: u64, stream: u64, id: u64) -> StdRng {
    StdRng::seed_from_u64(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ id.wrapping_mul(0xD1B5_4A32_D192_ED03))
}

impl Workload {
    /// Request `id` (for multi-turn: the first turn of conversation `id`).
    pub fn request(&self, id: u64) -> RequestSpec {
        let mut rng = rng_for(self.seed, 1, id);
        let max_tokens = self.output.sample(&mut rng);
        match &self.kind {
            WorkloadKind::Synthetic | WorkloadKind::MultiTurn { .. } => {
                let n = self.input.sample(&mut rng);
                RequestSpec { id, messages: vec![user(text(&mut rng, n))], max_tokens, at_s: None }
            }
            WorkloadKind::SharedPrefix { groups, prefix_len } => {
                let group = rng.random_range(0..u64::from(*groups));
                let prefix = text(&mut rng_for(self.seed, 2, group), *prefix_len);
                let n = self.input.sample(&mut rng);
                let system = Message { role: "system".into(), content: prefix };
                RequestSpec { id, messages: vec![system, user(text(&mut rng, n))], max_tokens, at_s: None }
            }
            WorkloadKind::Trace { requests, .. } => {
                let mut r = requests[(id as usize) % requests.len()].clone();
                r.id = id;
                r
            }
        }
    }

    /// The next turn of a conversation whose history (with the assistant's replies) is given.
    pub fn next_turn(&self, conversation: u64, turn: u32, history: &[Message]) -> RequestSpec {
        let mut rng = rng_for(self.seed, 3, conversation * 1_000 + u64::from(turn));
        let n = self.input.sample(&mut rng);
        let mut messages = history.to_vec();
        messages.push(user(text(&mut rng, n)));
        RequestSpec { id: conversation, messages, max_tokens: self.output.sample(&mut rng), at_s: None }
    }

    /// Number of requests a trace holds.
    pub fn trace_len(&self) -> Option<usize> {
        match &self.kind {
            WorkloadKind::Trace { requests, .. } => Some(requests.len()),
            _ => None,
        }
    }
}

fn user(content: String) -> Message {
    Message { role: "user".into(), content }
}

/// Load a JSONL trace: each line `{"timestamp": s, "prompt": "…"}` or `{"messages": […]}`,
/// optional `"max_tokens"` (else drawn from `default_output`).
pub fn load_trace(text_: &str, default_output: &LengthDist, seed: u64) -> Result<Vec<RequestSpec>, String> {
    let mut out = Vec::new();
    let mut rng = rng_for(seed, 4, 0);
    for (i, line) in text_.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("trace line {}: {e}", i + 1))?;
        let messages = if let Some(p) = v["prompt"].as_str() {
            vec![user(p.to_string())]
        } else if let Some(ms) = v["messages"].as_array() {
            ms.iter()
                .map(|m| match (m["role"].as_str(), m["content"].as_str()) {
                    (Some(r), Some(c)) => Ok(Message { role: r.into(), content: c.into() }),
                    _ => Err(format!("trace line {}: each message needs string role and content", i + 1)),
                })
                .collect::<Result<_, _>>()?
        } else {
            return Err(format!("trace line {}: needs \"prompt\" or \"messages\"", i + 1));
        };
        let max_tokens = match v.get("max_tokens") {
            Some(m) => {
                m.as_u64().filter(|m| *m >= 1).ok_or_else(|| format!("trace line {}: bad max_tokens", i + 1))? as u32
            }
            None => default_output.sample(&mut rng),
        };
        let at_s = v["timestamp"].as_f64();
        out.push(RequestSpec { id: out.len() as u64, messages, max_tokens, at_s });
    }
    if out.is_empty() {
        return Err("the trace has no requests".into());
    }
    let t0 = out.iter().filter_map(|r| r.at_s).fold(f64::INFINITY, f64::min);
    for r in &mut out {
        r.at_s = r.at_s.map(|t| t - t0);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wl(kind: WorkloadKind) -> Workload {
        Workload { kind, input: LengthDist::Fixed { n: 50 }, output: "uniform:10:20".parse().unwrap(), seed: 7 }
    }

    #[test]
    fn requests_are_deterministic_per_seed_and_id() {
        let w = wl(WorkloadKind::Synthetic);
        assert_eq!(w.request(3), w.request(3));
        assert_ne!(w.request(3), w.request(4));
        let words = w.request(3).messages[0].content.split([' ', '.']).filter(|s| !s.is_empty()).count();
        assert!((45..=50).contains(&words), "{words}");
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt() {
        let w = wl(WorkloadKind::SharedPrefix { groups: 2, prefix_len: 300 });
        let reqs: Vec<_> = (0..20).map(|i| w.request(i)).collect();
        let prefixes: std::collections::HashSet<_> = reqs.iter().map(|r| r.messages[0].content.clone()).collect();
        assert_eq!(prefixes.len(), 2);
        let questions: std::collections::HashSet<_> = reqs.iter().map(|r| r.messages[1].content.clone()).collect();
        assert_eq!(questions.len(), 20);
    }

    #[test]
    fn length_distributions_parse_and_sample() {
        let mut rng = StdRng::seed_from_u64(1);
        for (s, lo, hi) in
            [("128", 128, 128), ("uniform:5:9", 5, 9), ("normal:100:10", 40, 160), ("lognormal:100:50", 1, 2000)]
        {
            let d: LengthDist = s.parse().unwrap();
            for _ in 0..200 {
                let v = d.sample(&mut rng);
                assert!((lo..=hi).contains(&v), "{s}: {v}");
            }
        }
        let d: LengthDist = "lognormal:200:100".parse().unwrap();
        let mean = (0..20_000).map(|_| f64::from(d.sample(&mut rng))).sum::<f64>() / 20_000.0;
        assert!((mean - 200.0).abs() < 6.0, "lognormal mean {mean}");
        for bad in ["0", "uniform:9:5", "zipf:1", "normal:x:1", "uniform:1"] {
            assert!(bad.parse::<LengthDist>().is_err(), "{bad}");
        }
    }

    #[test]
    fn traces_load_prompts_messages_and_relative_times() {
        let t = "{\"timestamp\": 10.5, \"prompt\": \"hi\", \"max_tokens\": 4}\n\n{\"timestamp\": 11, \"messages\": [{\"role\": \"user\", \"content\": \"yo\"}]}\n";
        let r = load_trace(t, &LengthDist::Fixed { n: 9 }, 0).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].max_tokens, r[1].max_tokens), (4, 9));
        assert_eq!((r[0].at_s, r[1].at_s), (Some(0.0), Some(0.5)));
        assert!(load_trace("{\"x\": 1}", &LengthDist::Fixed { n: 1 }, 0).unwrap_err().contains("line 1"));
    }
}
