//! `cluster`: a local Switchyard cluster for one run.
//!
//! Starts N engines (`--port 0`, each reports its address), writes a gateway config for
//! them with the chosen policy, starts the gateway (`--gateways N`: N replicas, the requests
//! spread over them; `--kv-events`: engines publish KV events and every replica subscribes),
//! waits until it has scraped every engine, runs the workload against the gateway (or, with
//! `--no-gateway`, against each engine), polls the engines' KV usage during the run, and scrapes their counters at the
//! end (prefix-cache queries and hits, preemptions, generated tokens). Every process is
//! killed when the run ends, fails or is interrupted (Ctrl-C): children are owned by
//! guards that kill on drop.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use http_body_util::{BodyExt, Empty};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::cli::{ClusterArgs, RunArgs};
use crate::client::Target;

fn sibling_bin(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.parent().context("binary directory")?.join(name);
    if !path.exists() {
        bail!(
            "{} not found next to switchyard-loadtest; build it: cargo build --release -p switchyard-engine -p switchyard-gateway",
            path.display()
        );
    }
    Ok(path)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<bytes::Bytes>>();
    let resp = client.get(format!("http://{addr}{path}").parse()?).await?;
    let body = resp.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

struct Engine {
    child: Child,
    addr: SocketAddr,
    /// Its KV events' PUB and replay endpoints, as a gateway connects to them.
    kv_events: Option<(String, String)>,
}

impl Engine {
    /// Kill the engine and wait until it is gone (its port closed), so that a finished run
    /// leaves nothing behind.
    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

async fn start_engine(c: &ClusterArgs) -> anyhow::Result<Engine> {
    let mut cmd = Command::new(sibling_bin("switchyard-engine")?);
    cmd.args(["--host", "127.0.0.1", "--port", "0", "--backend", &c.backend, "--sim-profile", &c.sim_profile]);
    if let Some(t) = &c.tokenizer {
        cmd.arg("--tokenizer").arg(t);
    }
    let kv_events = if c.kv_events {
        let (p, r) = (free_port()?, free_port()?);
        let config = serde_json::json!({
            "enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": format!("tcp://*:{p}"), "replay_endpoint": format!("tcp://*:{r}"),
        });
        cmd.arg("--kv-events-config").arg(config.to_string());
        Some((format!("tcp://127.0.0.1:{p}"), format!("tcp://127.0.0.1:{r}")))
    } else {
        None
    };
    cmd.args(&c.engine_args).env("RUST_LOG", "warn").stdout(Stdio::piped()).kill_on_drop(true);
    let mut child = cmd.spawn().context("starting switchyard-engine")?;
    let mut lines = BufReader::new(child.stdout.take().context("engine stdout")?).lines();
    let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .context("engine did not start within 60 s")??
        .context("engine exited before listening")?;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let addr = first.trim().strip_prefix("listening on http://").context("unexpected engine output")?.parse()?;
    Ok(Engine { child, addr, kv_events })
}

/// Start gateway replica `n` in front of `engines` (config and log under `dir`) and wait
/// until it has scraped every engine. Returns the process and its API address.
async fn start_gateway(
    c: &ClusterArgs,
    engines: &[Engine],
    dir: &std::path::Path,
    n: usize,
) -> anyhow::Result<(Child, SocketAddr)> {
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let mut yaml = format!(
        "listen: {listen}\nadmin_listen: {admin}\nthreads: {}\npolicy: {{ type: {} }}\n",
        c.gateway_threads, c.policy
    );
    if c.kv_events {
        yaml.push_str("kv_events:\n  block_size: 16\n");
        if let Some(t) = &c.tokenizer {
            yaml.push_str(&format!("  tokenizer: {}\n", serde_json::to_string(&t.display().to_string())?));
        }
    }
    yaml.push_str("discovery:\n  static:\n");
    for e in engines {
        yaml.push_str(&format!("    - url: http://{}\n", e.addr));
        if let Some((endpoint, replay)) = &e.kv_events {
            yaml.push_str(&format!("      kv_events: {endpoint}\n      kv_events_replay: {replay}\n"));
        }
    }
    let config = dir.join(format!("gateway{n}.yaml"));
    std::fs::write(&config, yaml)?;
    let log_path = dir.join(format!("gateway{n}.log"));
    let log = std::fs::File::create(&log_path)?;
    let child = Command::new(sibling_bin("switchyard-gateway")?)
        .arg("--config")
        .arg(&config)
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("starting switchyard-gateway")?;
    let start = Instant::now();
    loop {
        if let Ok(text) = get(admin, "/admin/backends").await {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            let up = v["backends"].as_array().map_or(0, |b| {
                b.iter().filter(|x| x["state"] == "up" && x["models"].as_array().is_some_and(|m| !m.is_empty())).count()
            });
            if up == engines.len() {
                return Ok((child, listen));
            }
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("the gateway did not see every engine within 30 s; see {}", log_path.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Start `--router` (its command with the placeholders filled in) in its own process group,
/// log under `dir`, and wait until it answers 200 on `ready_path`.
async fn start_router(
    template: &str,
    ready_path: &str,
    engines: &[Engine],
    dir: &std::path::Path,
) -> anyhow::Result<(Child, SocketAddr)> {
    let port = free_port()?;
    let workers: Vec<String> = engines.iter().map(|e| format!("http://{}", e.addr)).collect();
    let command = template
        .replace("{port}", &port.to_string())
        .replace("{metrics_port}", &free_port()?.to_string())
        .replace("{workers}", &workers.join(" "));
    let log_path = dir.join("router.log");
    let log = std::fs::File::create(&log_path)?;
    let child = Command::new("sh")
        .arg("-c")
        .arg(format!("exec {command}"))
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("starting --router")?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let start = Instant::now();
    loop {
        let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http::<Empty<bytes::Bytes>>();
        if let Ok(resp) = client.get(format!("http://{addr}{ready_path}").parse()?).await {
            if resp.status().is_success() {
                return Ok((child, addr));
            }
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("--router did not answer {ready_path} within 60 s; see {}", log_path.display());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// CPU seconds (user + system, every thread) `child` has used, from `/proc/<pid>/stat`
/// (0 where that cannot be read: another OS, or the process is gone).
fn cpu_seconds(child: &Child) -> f64 {
    let Some(stat) = child.id().and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()) else {
        return 0.0;
    };
    // Fields after the `(comm)`, which may hold spaces: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map_or("", |x| x.1);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i - 3).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Clock ticks are 1/100 s on every Linux this runs on (USER_HZ).
    (ticks(14) + ticks(15)) / 100.0
}

/// Sum of every sample named `name`.
fn sum(samples: &[switchyard_shim::text::Sample], name: &str) -> f64 {
    samples.iter().filter(|s| s.name == name).map(|s| s.value).sum()
}

/// Run `run` against a cluster built from `c`.
pub async fn run_cluster(c: &ClusterArgs, mut run: RunArgs) -> anyhow::Result<()> {
    if c.engines == 0 {
        bail!("--engines must be >= 1");
    }
    let mut engines = Vec::new();
    for _ in 0..c.engines {
        engines.push(start_engine(c).await?);
    }
    let mut gateways = Vec::new();
    if let Some(router) = &c.router {
        let dir = run.out.join("cluster");
        std::fs::create_dir_all(&dir)?;
        let (child, listen) = start_router(router, &c.router_ready_path, &engines, &dir).await?;
        gateways.push(child);
        run.targets.insert(0, Target::new("router", format!("http://{listen}")));
    } else if c.no_gateway {
        for (i, e) in engines.iter().enumerate() {
            run.targets.push(Target::new(format!("engine{i}"), format!("http://{}", e.addr)));
        }
    } else {
        if c.gateways == 0 {
            bail!("--gateways must be >= 1");
        }
        let dir = run.out.join("cluster");
        std::fs::create_dir_all(&dir)?;
        let mut urls = Vec::new();
        for n in 0..c.gateways {
            let (child, listen) = start_gateway(c, &engines, &dir, n).await?;
            gateways.push(child);
            urls.push(format!("http://{listen}"));
        }
        let base_url = urls.remove(0);
        run.targets.insert(0, Target { name: "gateway".into(), base_url, replicas: urls });
    }

    // Peak KV usage per engine while the run goes on.
    let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr).collect();
    let peak_kv = Arc::new(Mutex::new(vec![0.0f64; addrs.len()]));
    let poller = {
        let (addrs, peak_kv) = (addrs.clone(), peak_kv.clone());
        tokio::spawn(async move {
            loop {
                for (i, a) in addrs.iter().enumerate() {
                    if let Ok(text) = get(*a, "/metrics").await {
                        if let Ok(samples) = switchyard_shim::text::parse_samples(&text) {
                            let kv = sum(&samples, "vllm:kv_cache_usage_perc");
                            let mut p = peak_kv.lock().expect("peak lock");
                            p[i] = p[i].max(kv);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let outcome = async {
        let plan = crate::plan_from_args(&run).await?;
        let mut before = Vec::new();
        for a in &addrs {
            before.push(switchyard_shim::text::parse_samples(&get(*a, "/metrics").await?)?);
        }
        let collect = || async {
            let mut per_engine = Vec::new();
            let (mut hits, mut queries) = (0.0, 0.0);
            for (i, a) in addrs.iter().enumerate() {
                let s = switchyard_shim::text::parse_samples(&get(*a, "/metrics").await?)?;
                let d = |n: &str| sum(&s, n) - sum(&before[i], n);
                hits += d("vllm:prefix_cache_hits_total");
                queries += d("vllm:prefix_cache_queries_total");
                per_engine.push(serde_json::json!({
                    "url": format!("http://{a}"),
                    "prefix_cache_hits": d("vllm:prefix_cache_hits_total"),
                    "prefix_cache_queries": d("vllm:prefix_cache_queries_total"),
                    "preemptions": d("vllm:num_preemptions_total"),
                    "generation_tokens": d("vllm:generation_tokens_total"),
                    "peak_kv_usage": peak_kv.lock().expect("peak lock")[i],
                }));
            }
            let rate = if queries > 0.0 { hits / queries } else { 0.0 };
            anyhow::Ok(serde_json::json!({
                "engines": per_engine, "prefix_cache_hit_rate": rate,
                "policy": match (&c.router, c.no_gateway) {
                    (Some(r), _) => format!("router: {r}"),
                    (None, true) => "none".to_string(),
                    (None, false) => c.policy.clone(),
                },
                "gateways": if c.no_gateway { 0 } else { c.gateways },
                "kv_events": c.kv_events,
                "tokenizer": c.tokenizer,
                "sim_profile": c.sim_profile,
            }))
        };
        // Counters cover the whole run (all targets and points).
        let cpu_before: Vec<f64> = gateways.iter().map(cpu_seconds).collect();
        let (summary, _) = crate::execute(&plan, &run, serde_json::Value::Null).await?;
        let mut cluster = collect().await?;
        let cpu: Vec<f64> = gateways.iter().map(cpu_seconds).zip(cpu_before).map(|(a, b)| a - b).collect();
        cluster["gateway_cpu_s"] = serde_json::json!(cpu);
        eprintln!(
            "cluster: aggregate prefix-cache hit rate {:.1}%",
            cluster["prefix_cache_hit_rate"].as_f64().unwrap_or(0.0) * 100.0
        );
        let mut summary = summary;
        summary.config["cluster"] = cluster;
        let path = run.out.join("summary.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&summary)?)?;
        anyhow::Ok(())
    };
    let result = tokio::select! {
        r = outcome => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted; the cluster was torn down")),
    };
    poller.abort();
    drop(gateways);
    for engine in engines {
        engine.stop().await;
    }
    result
}
