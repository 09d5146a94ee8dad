//! Shared helpers for Switchyard's test suites: an HTTP client with chunk timing and
//! disconnects ([`client`]), Prometheus parsing, and spawning the real binaries on
//! loopback ([`procs`]), a typed gateway config ([`gateway_config`]), a scripted fault
//! engine ([`fault`]), an engine that answers every OpenAI route ([`route_engine`]) and a
//! real vLLM ([`vllm`]).
//! Every port comes from the OS (`127.0.0.1:0`); nothing leaves the machine.

pub mod client;
pub mod fake_kube;
pub mod fault;
pub mod gateway_config;
pub mod pki;
pub mod procs;
pub mod route_engine;
pub mod vllm;

pub use client::*;
pub use fault::{Fault, FaultEngine};
pub use gateway_config::{sha256, ApiKey, GatewayConfigBuilder};
pub use procs::*;
pub use route_engine::{adapter_card, model_card, RouteEngine};
pub use vllm::{vllm_model_dir, VllmProc, VLLM_CPU_BLOCK_SIZE, VLLM_MODEL, VLLM_VERSION};
