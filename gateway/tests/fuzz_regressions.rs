//! Replays the fuzz seeds and every input the fuzzer ever found (gateway/fuzz/corpus and
//! gateway/fuzz/regressions) through their targets — the request path, the KV-event decoder —
//! on the stable toolchain, in CI.

use std::path::Path;

#[test]
fn fuzz_seeds_and_past_findings_pass_the_request_path() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut replayed = 0;
    for dir in ["corpus/request", "regressions"] {
        let dir = root.join(dir);
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() || path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
                continue;
            }
            let data = std::fs::read(&path).unwrap();
            let outcome = std::panic::catch_unwind(|| switchyard_gateway::fuzzing::request_path(&data));
            assert!(outcome.is_ok(), "{} fails the request path", path.display());
            replayed += 1;
        }
    }
    assert!(replayed >= 6, "the seed corpus is missing ({replayed} inputs)");
}

#[test]
fn fuzz_seeds_and_past_findings_pass_the_kv_event_decoder() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut replayed = 0;
    for dir in ["corpus/kv_events", "regressions/kv_events"] {
        let dir = root.join(dir);
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
                continue;
            }
            let data = std::fs::read(&path).unwrap();
            let outcome = std::panic::catch_unwind(|| switchyard_gateway::fuzzing::kv_event_batch(&data));
            assert!(outcome.is_ok(), "{} fails the KV-event decoder", path.display());
            replayed += 1;
        }
    }
    assert!(replayed >= 11, "the seed corpus is missing ({replayed} inputs)");
}
