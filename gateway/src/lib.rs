//! # switchyard-gateway
//!
//! The edge proxy in front of LLM engines, on pingora. It speaks the OpenAI API, streams
//! responses without buffering, and sends each request to the engine where it will start
//! soonest, judged by the engines' own queue and KV-cache signals (scraped in the
//! background) and by its own in-flight counts.
//!
//! Layout (docs/architecture.md has the picture):
//! - [`server`] wires pingora: listeners, services, the drain signal; [`connection`] guards
//!   the API listener's connections (how many, how long before they speak);
//! - [`config`] (file, validation) → [`state`] (what is in force, swapped atomically) →
//!   [`cluster`] (backends, health) → [`policy`] (pure routing decisions);
//! - [`aliases`] (model aliases and weighted splits, pure);
//! - [`proxy`] is the request path, as named phases over one per-request context; [`epp`]
//!   runs the same phases for another gateway (Envoy's ext_proc), which makes the exchange;
//! - background services: [`scrape`] (engine load), [`discovery`] (static, DNS,
//!   Kubernetes), [`reload`] (config, certificates, pool sweep); [`drain`] on SIGTERM;
//! - [`admin`] and [`metrics`]; [`auth`], [`admission`], [`retry`] and [`pool`] are the
//!   edge's building blocks.
//!
//! Only [`run`], [`GatewayConfig`], (feature `fuzzing`) the fuzz entry point and the pure
//! [`kv_events`] decoder and index (their memory is measured by a test with its own global
//! allocator) are public: everything else is crate-private, so the compiler finds what nothing
//! uses.

pub(crate) mod access_log;
pub(crate) mod active;
pub(crate) mod admin;
pub(crate) mod admission;
pub mod aliases;
pub mod alloc;
pub(crate) mod auth;
pub(crate) mod body_budget;
pub(crate) mod cluster;
pub mod config;
pub(crate) mod connection;
pub(crate) mod cores;
pub(crate) mod deadline;
pub(crate) mod discovery;
pub mod downstream;
pub(crate) mod drain;
pub(crate) mod epp;
pub mod error;
pub(crate) mod ewma;
pub(crate) mod framing;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub(crate) mod http;
pub mod kv_events;
pub(crate) mod metrics;
pub(crate) mod policy;
pub(crate) mod pool;
pub(crate) mod prefix;
pub(crate) mod proxy;
pub(crate) mod reload;
pub(crate) mod request;
pub(crate) mod retry;
pub(crate) mod scrape;
pub(crate) mod server;
pub(crate) mod shared_limits;
pub(crate) mod state;
pub(crate) mod tls;
pub(crate) mod upstream;

pub use config::GatewayConfig;
pub use server::run;
