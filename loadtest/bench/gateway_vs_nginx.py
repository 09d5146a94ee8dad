#!/usr/bin/env python3
"""Gateway vs NGINX in front of the same fast upstream, on the same machine, in one run.

Upstream: `switchyard-engine --sim-profile instant` (zero-time steps). NGINX (Debian's) is
configured as people run it for SSE: `proxy_buffering off`, HTTP/1.1 keep-alive upstream
pool, a buffered access log (the gateway writes a JSON access-log line per request too).
Both get 2 workers. Measured with switchyard-loadtest:

1. saturation: requests/s of short streamed completions, closed loop (64 concurrent);
2. latency added over a direct connection at half the lower saturation rate (open loop,
   Poisson): e2e and TTFT p50/p99 of each path minus direct;
3. memory: RSS with 1,000 open streams (a slow `h100-llama3-8b` engine keeps them open).

Bars (issue #3): gateway requests/s at saturation ≥ 0.8× NGINX's; gateway e2e p99 added over
direct ≤ 2 ms; gateway RSS with 1,000 open streams < 100 MB. Prints the figures, then each bar
with its measured value; exits 1 when a bar is missed, 2 when it could not measure.

The gateway routes with `--policy` (default `least_load`, the cheapest per request; `cost`,
the gateway's default, also prices each prompt against the prefix index).
Usage: python3 loadtest/bench/gateway_vs_nginx.py [--quick] [--policy NAME] [--gateway-bin PATH]
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bars import Bars, SetupError, run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release")
WORK = os.path.join(ROOT, ".cache", "bench", "gateway-vs-nginx")
POLICY = "least_load"  # the benchmarked gateway's routing policy (--policy)
GATEWAY_BIN = None  # the benchmarked gateway binary (--gateway-bin; default: the one built here)
procs = []


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


def start_engine(*args):
    p = spawn([f"{BIN}/switchyard-engine", "--host", "127.0.0.1", "--port", "0", *args],
              stdout=subprocess.PIPE, text=True, env={**os.environ, "RUST_LOG": "warn"})
    line = p.stdout.readline().strip()
    if not line.startswith("listening on http://"):
        raise SetupError(f"switchyard-engine {' '.join(args)} did not start: {line!r}")
    return p, line.removeprefix("listening on ")


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


def start_gateway(name, engine_url):
    port, admin = free_port(), free_port()
    cfg = os.path.join(WORK, f"{name}.yaml")
    with open(cfg, "w") as f:
        f.write(f"listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\nthreads: 2\n"
                f"discovery:\n  static:\n    - url: {engine_url}\npolicy: {{ type: {POLICY} }}\n"
                # e.g. SWITCHYARD_BENCH_GATEWAY_EXTRA='work_stealing: false' to compare settings
                + os.environ.get("SWITCHYARD_BENCH_GATEWAY_EXTRA", "") + "\n")
    log = open(os.path.join(WORK, f"{name}.log"), "w")
    p = spawn([GATEWAY_BIN or f"{BIN}/switchyard-gateway", "--config", cfg], stdout=log, stderr=log,
              env={**os.environ, "RUST_LOG": "info"})
    wait_http(f"http://127.0.0.1:{port}/-/ready")
    return p, f"http://127.0.0.1:{port}"


def start_nginx(name, engine_url):
    port = free_port()
    prefix = os.path.join(WORK, name)
    os.makedirs(os.path.join(prefix, "logs"), exist_ok=True)
    upstream = engine_url.removeprefix("http://")
    conf = os.path.join(prefix, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"""
daemon off;
worker_processes 2;
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
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return p, f"http://127.0.0.1:{port}"


def loadtest(out, targets, *args):
    cmd = [f"{BIN}/switchyard-loadtest", "run", "--endpoint", "completions", "--input-len", "16",
           "--output-len", "16", "--seed", "1", "--out", os.path.join(WORK, out)]
    for name, url in targets:
        cmd += ["--target", f"{name}={url}"]
    done = subprocess.run(cmd + list(args), stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SetupError(f"switchyard-loadtest failed ({out}):\n{done.stderr[-2000:]}")
    with open(os.path.join(WORK, out, "summary.json")) as f:
        return {t["target"]: t for t in json.load(f)["targets"]}


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


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure(targets, rounds_n, duration, half_of, *extra):
    """Saturation requests/s (64 concurrent, closed loop), then e2e/TTFT p50/p99 at half the
    lowest saturation rate among `half_of` (Poisson). Rounds alternate the targets and each
    figure is the median over rounds: on a shared 2-core machine, back-to-back runs of the
    same target vary by ±15%. Returns (rps by target, the half rate, latencies by target)."""
    def rounds(out, *args):
        per = {name: [] for name, _ in targets}
        for r in range(rounds_n):
            for t in targets:
                per[t[0]].append(loadtest(f"{out}-{r}-{t[0]}", [t], *extra, *args)[t[0]])
        return per

    sat = rounds("saturation", "--concurrency", "64", "--duration-s", duration, "--warmup", "200")
    for name, runs in sat.items():
        for x in runs:
            if x.get("failed", 0):
                raise SetupError(f"{name}: {x['failed']} failed requests; see {WORK}")
    rps = {k: median([x["requests_per_s"] for x in v]) for k, v in sat.items()}
    half = 0.5 * min(rps[k] for k in half_of)
    lat_rounds = rounds("half-load", "--rate", f"{half:.1f}", "--duration-s", duration, "--warmup", "100")
    lat = {k: {m: {q: median([x[m][q] for x in v]) for q in ["p50", "p99"]} for m in ["e2e_ms", "ttft_ms"]}
           for k, v in lat_rounds.items()}
    return rps, half, lat


def added(lat, target, metric, q):
    """Latency `metric` at quantile `q` through `target` minus the direct path's (ms)."""
    return lat[target][metric][q] - lat["direct"][metric][q]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 3 s (a smoke run, not the benchmark)")
    ap.add_argument("--policy", default="least_load",
                    help="the gateway's routing policy (least_load, cost, round_robin, ...; default least_load)")
    ap.add_argument("--gateway-bin", default=None,
                    help="benchmark this gateway binary instead of the one built (e.g. an older build, before/after)")
    return ap.parse_args(argv)


def main():
    global POLICY, GATEWAY_BIN
    args = parse_args()
    POLICY, GATEWAY_BIN = args.policy, args.gateway_bin
    duration, rounds_n = ("3", 1) if args.quick else ("5", 3)
    if not shutil.which("nginx"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "nginx-light"], check=True)
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "switchyard-engine", "-p", "switchyard-gateway",
                    "-p", "switchyard-loadtest"], cwd=ROOT, check=True)
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    _, fast = start_engine("--sim-profile", "instant")
    _, gw = start_gateway("gateway", fast)
    _, ngx = start_nginx("nginx", fast)
    targets = [("direct", fast), ("nginx", ngx), ("gateway", gw)]

    rps, half, lat = measure(targets, rounds_n, duration, ["nginx", "gateway"], "--prewarm-connections", "64")

    slow_procs = []
    _, slow = start_engine("--sim-profile", "h100-llama3-8b", "--max-num-seqs", "1100")
    gw2, gw_slow = start_gateway("gateway-1000", slow)
    ngx2, ngx_slow = start_nginx("nginx-1000", slow)
    mem = {}
    for name, url, pids in [("gateway", gw_slow, lambda: [gw2.pid]), ("nginx", ngx_slow, lambda: [ngx2.pid] + children(ngx2.pid))]:
        lt = subprocess.Popen([f"{BIN}/switchyard-loadtest", "run", "--endpoint", "completions", "--target", f"{name}={url}",
                               "--input-len", "16", "--output-len", "120", "--concurrency", "1000", "--requests", "1000",
                               "--out", os.path.join(WORK, f"rss-{name}")], stderr=subprocess.DEVNULL)
        time.sleep(3.0)
        mem[name] = rss_mb(pids())
        lt.wait()

    print(f"\n## Gateway (policy {POLICY}) vs NGINX (same upstream, same 2 cores)\n")
    print("| figure | direct | nginx | gateway | gateway ÷ nginx | bar |")
    print("|---|---:|---:|---:|---:|---|")
    print(f"| requests/s at saturation (64 concurrent, 16 in / 16 out, streamed; median of {rounds_n}) | {rps['direct']:.0f} | {rps['nginx']:.0f} | "
          f"{rps['gateway']:.0f} | {rps['gateway'] / rps['nginx']:.2f}× | ≥ 0.8× |")
    for metric, label in [("e2e_ms", "e2e"), ("ttft_ms", "TTFT")]:
        for q in ["p50", "p99"]:
            print(f"| {label} {q} added over direct at {half:.0f} req/s, Poisson (ms; median of {rounds_n}) | 0 | {added(lat, 'nginx', metric, q):+.2f} | "
                  f"{added(lat, 'gateway', metric, q):+.2f} | | {'≤ 2 ms' if q == 'p99' else ''} |")
    print(f"| RSS with 1,000 open streams (MB) | | {mem['nginx']:.1f} | {mem['gateway']:.1f} | "
          f"{mem['gateway'] / mem['nginx']:.2f}× | < 100 MB |")
    print(f"\n(reports under {WORK})")
    bars = Bars()
    bars.check(f"gateway ({POLICY}) ÷ NGINX requests/s at saturation", rps["gateway"] / rps["nginx"], ">=", 0.8, "×")
    bars.check(f"gateway ({POLICY}) e2e p99 added over direct", added(lat, "gateway", "e2e_ms", "p99"), "<=", 2.0, " ms")
    bars.check("gateway RSS with 1,000 open streams", mem["gateway"], "<", 100, " MB")
    return bars


def kill_all():
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except Exception:
            pass


if __name__ == "__main__":
    run(main, cleanup=kill_all)
