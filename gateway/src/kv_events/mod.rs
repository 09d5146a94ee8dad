//! Engine KV-cache events (#19): what each engine really caches, from the events vLLM (and
//! `switchyard-engine --kv-events-config`) publish over ZMQ.
//!
//! So far: [`wire`], the decoder for every layout vLLM has shipped; [`index`], the pure block
//! index built from decoded batches; [`subscriber`], one ZMQ subscription per engine feeding
//! it (with replays on gaps), shown in `/admin/backends`. Tokenizing requests in the gateway
//! and the policies reading the index are the next steps (see the issue).

pub mod index;
pub(crate) mod subscriber;
pub mod wire;
