//! Fuzz the decoder of engines' KV-event batches (see `switchyard_gateway::fuzzing`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    switchyard_gateway::fuzzing::kv_event_batch(data);
});
