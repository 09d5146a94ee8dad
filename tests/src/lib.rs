//! Shared helpers for Switchyard's test suites: an HTTP client with chunk timing and
//! disconnects ([`client`]), Prometheus parsing, and spawning the real binaries on
//! loopback ([`procs`]), a typed gateway config ([`gateway_config`]) and a scripted fault
//! engine ([`fault`]). Every port comes from the OS (`127.0.0.1:0`); nothing leaves
//! the machine.

pub mod client;
pub mod fake_kube;
pub mod fault;
pub mod gateway_config;
pub mod pki;
pub mod procs;

pub use client::*;
pub use fault::{Fault, FaultEngine};
pub use gateway_config::{sha256, ApiKey, GatewayConfigBuilder};
pub use procs::*;
