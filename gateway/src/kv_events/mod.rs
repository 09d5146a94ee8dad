//! Engine KV-cache events (#19): what each engine really caches, from the events vLLM (and
//! `switchyard-engine --kv-events-config`) publish over ZMQ.
//!
//! So far: [`wire`], the decoder for every layout vLLM has shipped, and [`index`], the pure
//! block index built from decoded batches. The subscriber per engine, tokenizing requests in
//! the gateway and the policies reading the index are the next steps (see the issue).

pub mod index;
pub mod wire;
