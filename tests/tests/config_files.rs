//! Every file in `config/` is a valid gateway config, `--validate` reports field errors, and
//! every test `.config/nextest.toml` names exists.

use std::process::Command;

use switchyard_testkit::{scratch_dir, workspace_bin};

fn config_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config")
}

/// `switchyard-gateway --config PATH --validate`.
fn validate(path: &std::path::Path) -> std::process::Output {
    Command::new(workspace_bin("switchyard-gateway")).arg("--config").arg(path).arg("--validate").output().unwrap()
}

#[test]
fn every_config_file_validates() {
    let mut checked = 0;
    for entry in std::fs::read_dir(config_dir()).expect("config/ exists") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml" || e == "yml") && path.to_string_lossy().contains("gateway") {
            let out = validate(&path);
            assert!(out.status.success(), "{}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
            checked += 1;
        }
    }
    assert!(checked >= 1, "no gateway config found in config/");
}

#[test]
fn validate_prints_every_field_error_and_fails() {
    let dir = scratch_dir("validate");
    let path = dir.join("bad.yaml");
    std::fs::write(
        &path,
        "listen: nowhere\ndiscovery:\n  static:\n    - url: ftp://a:1\nretries: { max_attempts: 0 }\n",
    )
    .unwrap();
    let out = validate(&path);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in ["listen: must be IP:PORT", "discovery.static[0].url", "retries.max_attempts"] {
        assert!(err.contains(needle), "missing {needle:?} in {err}");
    }
}

/// Every test `.config/nextest.toml` names (`test(=NAME)`, e.g. the `timing` group) exists: a
/// renamed test must not silently leave its group.
#[test]
fn every_test_named_in_the_nextest_config_exists() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let config = std::fs::read_to_string(root.join(".config/nextest.toml")).expect(".config/nextest.toml");
    let mut sources = String::new();
    for dir in ["tests/tests", "engine/tests", "gateway/tests"] {
        for entry in std::fs::read_dir(root.join(dir)).into_iter().flatten() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "rs") {
                sources.push_str(&std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let names: Vec<&str> = config.split("test(=").skip(1).map(|rest| rest.split(')').next().unwrap()).collect();
    assert!(names.len() >= 10, "the timing group names its tests: {names:?}");
    let missing: Vec<&&str> = names.iter().filter(|n| !sources.contains(&format!("fn {n}("))).collect();
    assert!(missing.is_empty(), "tests named in .config/nextest.toml that no longer exist: {missing:?}");
}
