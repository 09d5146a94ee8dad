//! Fuzz the gateway's request path: head checks, API key lookup, routing fields, canonical
//! prompt, block hashes, prefix index and policies (see `switchyard_gateway::fuzzing`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    switchyard_gateway::fuzzing::request_path(data);
});
