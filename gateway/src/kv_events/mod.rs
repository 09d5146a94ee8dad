//! Engine KV-cache events (#19): what each engine really caches, from the events vLLM (and
//! `switchyard-engine --kv-events-config`) publish over ZMQ.
//!
//! So far: [`wire`], the decoder for every layout vLLM has shipped. The subscriber per engine
//! and the block index the policies will read are the next steps (see the issue).

pub mod wire;
