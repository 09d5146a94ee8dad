//! Engine KV-cache events: what each engine really caches, from the events vLLM (and
//! `switchyard-engine --kv-events-config`) publish over ZMQ, for precise prefix routing.
//!
//! [`wire`] decodes every layout vLLM has shipped; [`index`] is the pure block index built
//! from decoded batches; [`subscriber`] follows one ZMQ stream per engine into it (with
//! replays on gaps), shown in `/admin/backends`; [`prompt`] tokenizes a request's prompt
//! into the block keys the index is asked about.

pub mod index;
pub(crate) mod prompt;
pub(crate) mod subscriber;
pub mod wire;
