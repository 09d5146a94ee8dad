//! The request path's tokenizing service: a request's prompt turned into the block keys the
//! engines will cache it under (`kv_events.tokenizer`), so the [index](super::index) fed by
//! the engines' events ([`super::subscriber::KvEvents`]) can say what each engine holds of it.
//! The request driver asks it once the plan is made ([`PromptTokenizer::precise`]); without a
//! tokenizer there is no such service, and routing uses the approximate index alone.
//!
//! Tokenizing costs CPU in proportion to the prompt (about a millisecond per thousand new
//! tokens, seconds for a megabyte of random letters), so it never runs on the threads that
//! serve connections: a pool of `kv_events.tokenizer_threads` threads takes the prompts from
//! a bounded queue. A prompt is routed by the approximate index instead — and counted in
//! `switchyard_prompt_tokenizations_total{outcome}` — when its body is over
//! `kv_events.tokenize_max_bytes` (`too_large`), the queue is full (`busy`), or its keys are
//! not back within `kv_events.tokenize_timeout_ms` (`timeout`; a job whose request stopped
//! waiting is dropped unstarted).

use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use prometheus::{IntCounter, IntCounterVec};
use switchyard_tokenizer::{ModelTokenizer, PieceCache};

use super::index::{prompt_keys, BlockKey};
use crate::request::tokens::{prompt_token_ids, SeenPrompt};

/// Prompts a pool thread may have waiting for it.
const QUEUE_PER_THREAD: usize = 64;

/// A request's prompt as the engines will cache it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrecisePrompt {
    /// The keys of its full blocks, in order.
    pub keys: Vec<BlockKey>,
    /// Its length in tokens.
    pub tokens: u64,
}

/// The served model's tokenizer, with a cache of the pieces it has seen: the pure part,
/// run on the pool's threads.
#[derive(Debug)]
struct Tokenize {
    tokenizer: Arc<ModelTokenizer>,
    /// Token ids of prompt pieces seen before (`kv_events.tokenizer_cache_bytes`).
    pieces: PieceCache,
    /// The engines' block size in tokens (`kv_events.block_size`).
    block_size: usize,
}

impl Tokenize {
    fn precise_prompt(&self, body: &[u8], seen: SeenPrompt) -> Option<PrecisePrompt> {
        let ids = prompt_token_ids(body, seen, &self.tokenizer, &self.pieces)?;
        Some(PrecisePrompt { keys: prompt_keys(&ids, self.block_size), tokens: ids.len() as u64 })
    }
}

/// How the pool is sized and bounded (`kv_events`).
#[derive(Debug, Clone, Copy)]
pub struct PoolLimits {
    /// Threads that tokenize.
    pub threads: usize,
    /// Bodies over this are not tokenized.
    pub max_bytes: usize,
    /// How long a request waits for its keys.
    pub timeout: Duration,
}

/// What became of one prompt, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Precise,
    TooLarge,
    Busy,
    Timeout,
}

const OUTCOMES: [(Outcome, &str); 4] = [
    (Outcome::Precise, "precise"),
    (Outcome::TooLarge, "too_large"),
    (Outcome::Busy, "busy"),
    (Outcome::Timeout, "timeout"),
];

type Job = Box<dyn FnOnce() + Send>;

/// The tokenizing service: the tokenizer, its pool of threads and their queue.
pub struct PromptTokenizer {
    work: Arc<Tokenize>,
    jobs: SyncSender<Job>,
    limits: PoolLimits,
    /// One counter per [`Outcome`], in [`OUTCOMES`]' order.
    counts: [IntCounter; 4],
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer").field("work", &self.work).field("limits", &self.limits).finish()
    }
}

impl PromptTokenizer {
    /// Tokenize with `tokenizer` into `block_size`-token blocks, remembering up to
    /// `cache_bytes` of pieces, on a pool bounded by `limits`; outcomes are counted in
    /// `counter` (label `outcome`). The pool's threads end when this is dropped.
    pub fn new(
        tokenizer: Arc<ModelTokenizer>,
        cache_bytes: usize,
        block_size: usize,
        limits: PoolLimits,
        counter: &IntCounterVec,
    ) -> Self {
        let work = Arc::new(Tokenize { tokenizer, pieces: PieceCache::new(cache_bytes), block_size });
        let threads = limits.threads.max(1);
        let (jobs, queue) = sync_channel::<Job>(threads * QUEUE_PER_THREAD);
        let queue = Arc::new(Mutex::new(queue));
        for i in 0..threads {
            let queue = queue.clone();
            std::thread::Builder::new()
                .name(format!("tokenize-{i}"))
                .spawn(move || run_jobs(&queue))
                .expect("spawning a tokenizer thread");
        }
        let counts = OUTCOMES.map(|(_, label)| counter.with_label_values(&[label]));
        PromptTokenizer { work, jobs, limits, counts }
    }

    /// The prompt of `body` tokenized as the engine will (`None` for a body with no single
    /// prompt, see [`crate::request::tokens`], or one routed by the approximate index: see
    /// the module documentation); `seen`: what the routing pass read of it.
    pub async fn precise(&self, body: Bytes, seen: SeenPrompt) -> Option<PrecisePrompt> {
        let (outcome, prompt) = self.try_precise(body, seen).await;
        self.counts[OUTCOMES.iter().position(|(o, _)| *o == outcome).expect("every outcome is listed")].inc();
        prompt
    }

    async fn try_precise(&self, body: Bytes, seen: SeenPrompt) -> (Outcome, Option<PrecisePrompt>) {
        if body.len() > self.limits.max_bytes {
            return (Outcome::TooLarge, None);
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let work = self.work.clone();
        let job: Job = Box::new(move || {
            // The request stopped waiting (timed out, or its client left): nothing to do.
            if !tx.is_closed() {
                let _ = tx.send(work.precise_prompt(&body, seen));
            }
        });
        match self.jobs.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => return (Outcome::Busy, None),
        }
        match tokio::time::timeout(self.limits.timeout, rx).await {
            Ok(Ok(prompt)) => (Outcome::Precise, prompt),
            // The job was dropped unrun: a pool thread died with it.
            Ok(Err(_)) => (Outcome::Busy, None),
            Err(_) => (Outcome::Timeout, None),
        }
    }

    /// What `/admin/backends` shows of the piece cache and the pool.
    pub fn describe(&self) -> serde_json::Value {
        let (hits, misses) = self.work.pieces.counts();
        let outcomes: serde_json::Map<String, serde_json::Value> =
            OUTCOMES.iter().zip(&self.counts).map(|((_, label), c)| ((*label).to_string(), c.get().into())).collect();
        serde_json::json!({
            "piecewise": !self.work.pieces.is_off(), "cache_hits": hits, "cache_misses": misses,
            "cache_bytes": self.work.pieces.bytes(), "threads": self.limits.threads,
            "max_bytes": self.limits.max_bytes, "timeout_ms": self.limits.timeout.as_millis() as u64,
            "outcomes": outcomes,
        })
    }
}

/// A pool thread: jobs until the service is dropped. A panicking job (a tokenizer bug) is
/// contained: its request is routed approximately and the thread goes on.
fn run_jobs(queue: &Mutex<Receiver<Job>>) {
    loop {
        let job = match queue.lock() {
            Ok(q) => q.recv(),
            Err(poisoned) => poisoned.into_inner().recv(),
        };
        let Ok(job) = job else { return };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
            tracing::error!("a prompt's tokenization panicked; it is routed by the approximate index");
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tokenizer whose tokens are single characters (`a`-`z`, space, `<`, `>`, `|`, `_`,
    /// newline), with no chat template (ChatML).
    pub(crate) fn letters() -> Arc<ModelTokenizer> {
        let alphabet = "abcdefghijklmnopqrstuvwxyz <>|_\n";
        let mut vocab = serde_json::Map::new();
        vocab.insert("<eos>".into(), 0.into());
        for (i, c) in alphabet.chars().enumerate() {
            vocab.insert(c.to_string(), (i + 1).into());
        }
        let doc = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []},
        });
        let config = serde_json::json!({"eos_token": "<eos>"});
        Arc::new(ModelTokenizer::from_hf(doc.to_string().as_bytes(), Some(&config)).unwrap())
    }

    /// A chat asking "hello world", and its prompt as the engine renders it (ChatML:
    /// `<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n`).
    pub(crate) fn hello_world() -> (&'static [u8], String) {
        let text = switchyard_tokenizer::render_chatml(&[switchyard_tokenizer::ChatMessage {
            role: "user".into(),
            content: "hello world".into(),
        }]);
        (br#"{"messages":[{"role":"user","content":"hello world"}]}"#, text)
    }

    /// `body`'s prompt in `block_size`-token blocks of [`letters`], tokenized here and now.
    pub(crate) fn precise_now(body: &[u8], block_size: usize) -> Option<PrecisePrompt> {
        let t = Tokenize { tokenizer: letters(), pieces: PieceCache::new(1 << 20), block_size };
        t.precise_prompt(body, SeenPrompt::Unknown)
    }

    fn limits() -> PoolLimits {
        PoolLimits { threads: 1, max_bytes: 1 << 20, timeout: Duration::from_secs(30) }
    }

    fn counter() -> IntCounterVec {
        IntCounterVec::new(prometheus::Opts::new("t", "t"), &["outcome"]).unwrap()
    }

    fn count(c: &IntCounterVec, outcome: &str) -> u64 {
        c.with_label_values(&[outcome]).get()
    }

    #[test]
    fn a_prompt_becomes_the_block_keys_the_engine_caches_it_under() {
        let tokenizer = Tokenize { tokenizer: letters(), pieces: PieceCache::new(1 << 20), block_size: 4 };
        let (body, text) = hello_world();
        // A token a character.
        let prompt = tokenizer.precise_prompt(body, SeenPrompt::Unknown).expect("a chat tokenizes");
        assert_eq!(prompt.tokens, text.len() as u64);
        assert_eq!(prompt.keys.len(), text.len() / 4);
        assert_eq!(prompt.keys, prompt_keys(&letters().encode(&text), 4));
        // A completion's token ids are taken as they are; a batch has no single prompt.
        let ids = tokenizer.precise_prompt(br#"{"prompt":[1,2,3,4,5]}"#, SeenPrompt::Unknown).unwrap();
        assert_eq!((ids.tokens, ids.keys.len()), (5, 1));
        assert_eq!(tokenizer.precise_prompt(br#"{"prompt":["a","b"]}"#, SeenPrompt::Unknown), None);
    }

    /// The pool gives the pure function's answer; a body over the cap, a full queue and a
    /// late answer are routed without keys, each counted.
    #[tokio::test]
    async fn the_pool_answers_or_says_why_not() {
        let (body, _) = hello_world();
        let body = Bytes::from_static(body);
        let c = counter();
        let pool = PromptTokenizer::new(letters(), 1 << 20, 4, limits(), &c);
        let want = pool.work.precise_prompt(&body, SeenPrompt::Unknown);
        assert!(want.is_some());
        assert_eq!(pool.precise(body.clone(), SeenPrompt::Unknown).await, want);
        assert_eq!(count(&c, "precise"), 1);

        let small = PromptTokenizer::new(letters(), 1 << 20, 4, PoolLimits { max_bytes: 10, ..limits() }, &c);
        assert_eq!(small.precise(body.clone(), SeenPrompt::Unknown).await, None);
        assert_eq!(count(&c, "too_large"), 1);

        // One thread held by a job that waits: the next waits past its deadline, and once
        // the queue is full the rest are refused at once.
        let quick = PromptTokenizer::new(
            letters(),
            1 << 20,
            4,
            PoolLimits { timeout: Duration::from_millis(50), ..limits() },
            &c,
        );
        let (release, wait) = std::sync::mpsc::channel::<()>();
        quick
            .jobs
            .send(Box::new(move || {
                let _ = wait.recv();
            }))
            .unwrap();
        assert_eq!(quick.precise(body.clone(), SeenPrompt::Unknown).await, None);
        assert_eq!(count(&c, "timeout"), 1);
        for _ in 0..QUEUE_PER_THREAD {
            let _ = quick.jobs.try_send(Box::new(|| {}));
        }
        assert_eq!(quick.precise(body.clone(), SeenPrompt::Unknown).await, None);
        assert_eq!(count(&c, "busy"), 1);
        release.send(()).unwrap();
    }
}
