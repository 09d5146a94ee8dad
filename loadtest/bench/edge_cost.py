#!/usr/bin/env python3
"""The cost of the edge features: the gateway with TLS + API keys + rate limiters on, against
the same gateway in plain HTTP without keys, in one run, in front of the same upstream.

Upstream: `switchyard-engine --sim-profile instant`. The edge gateway serves TLS 1.3 (a
P-256 certificate from a throwaway CA made with openssl), requires an API key, and runs
that key's limiters on every request (a request rate and a token budget set far above the
load, so they count but never refuse). Measured with switchyard-loadtest over keep-alive
connections, 64 opened before each run (a client with a warm pool, as SDK clients have: an
open-loop run that starts cold against TLS spends itself on a storm of handshakes), 9 rounds
of 3 s taking the targets in turn (rotated a place a round), medians of rounds:

1. saturation: requests/s of short streamed completions, closed loop (64 concurrent);
2. latency added over a direct connection at half the lower saturation rate (Poisson);
3. full TLS handshakes per second (`openssl s_time -new`, a new session each time), with
   NGINX serving the same certificate as the anchor when nginx is installed.

Bar (issue #23): the edge features cost at most 10% of the requests/s (edge ÷ plain ≥ 0.90);
the latencies and handshakes are reported (README, Performance). Exits 0 when the bar is met,
1 when it is missed, 2 when it could not measure (a setup error).
Usage: python3 loadtest/bench/edge_cost.py [--quick] [--gateway-config YAML] [--rounds N]
(`--gateway-config`: lines added to both gateways' configs, e.g. `work_stealing: true`;
`--rounds`: default 9)
"""
import argparse
import hashlib
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import procs as base  # noqa: E402  (shared process helpers)
from bars import Bars, SetupError, run  # noqa: E402

ROOT = base.ROOT
BIN = base.BIN
WORK = os.path.join(ROOT, ".cache", "bench", "edge-cost")
KEY = "sk-bench-0123456789abcdef"


def make_pki():
    """A CA and a server certificate for 127.0.0.1 / localhost."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, cwd=WORK, capture_output=True)
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
        "-subj", "/CN=bench-ca", "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=localhost",
        "-keyout", "server.key", "-out", "server.csr")
    with open(os.path.join(WORK, "san.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "san.ext", "-out", "server.crt")
    return os.path.join(WORK, "ca.crt"), os.path.join(WORK, "server.crt"), os.path.join(WORK, "server.key")


def start_gateway(name, engine_url, extra, ca=None):
    port, admin = base.free_port(), base.free_port()
    cfg = os.path.join(WORK, f"{name}.yaml")
    with open(cfg, "w") as f:
        f.write(f"listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\nthreads: 2\n"
                f"discovery:\n  static:\n    - url: {engine_url}\npolicy: {{ type: least_load }}\n{extra}")
    log = open(os.path.join(WORK, f"{name}.log"), "w")
    base.spawn([f"{BIN}/switchyard-gateway", "--config", cfg], stdout=log, stderr=log,
               env={**os.environ, "RUST_LOG": "info"})
    scheme = "https" if ca else "http"
    ctx = ssl.create_default_context(cafile=ca) if ca else None
    start = time.time()
    while True:
        try:
            with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/-/ready", timeout=1, context=ctx) as r:
                if r.status == 200:
                    break
        except Exception:
            if time.time() - start > 30:
                raise SetupError(f"{name} did not come up: see {log.name}")
            time.sleep(0.05)
    return port, f"{scheme}://127.0.0.1:{port}"


def start_nginx_tls(cert, key, upstream):
    port = base.free_port()
    prefix = os.path.join(WORK, "nginx")
    os.makedirs(os.path.join(prefix, "logs"), exist_ok=True)
    conf = os.path.join(prefix, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"""
daemon off;
worker_processes 2;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  server {{
    listen 127.0.0.1:{port} ssl reuseport;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    ssl_protocols TLSv1.3;
    ssl_session_tickets off;
    location / {{ proxy_pass http://{upstream.removeprefix('http://')}; }}
  }}
}}
""")
    base.spawn(["nginx", "-p", prefix, "-c", conf], stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return port
        except OSError:
            time.sleep(0.05)
    return None


def handshakes_per_s(port, seconds):
    """Full handshakes per second (no resumption): openssl s_time -new."""
    out = subprocess.run(["openssl", "s_time", "-connect", f"127.0.0.1:{port}", "-new", "-time", str(seconds)],
                         capture_output=True, text=True).stdout
    m = re.search(r"(\d+) connections in ([\d.]+) real seconds", out)
    if not m:
        raise SetupError(f"openssl s_time gave no figure:\n{out}")
    return int(m.group(1)) / float(m.group(2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round (a smoke run, not the benchmark)")
    ap.add_argument("--gateway-config", default="", help="YAML lines added to both gateways' configs")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of 3 s (default 9)")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SetupError("--rounds must be at least 1")
    quick = args.quick
    extra = args.gateway_config + "\n" if args.gateway_config else ""
    duration = "3"
    rounds_n = 1 if quick else args.rounds
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "switchyard-engine", "-p", "switchyard-gateway",
                    "-p", "switchyard-loadtest"], cwd=ROOT, check=True)
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    base.WORK = WORK
    ca, cert, key = make_pki()
    _, fast = base.start_engine("--sim-profile", "instant")
    _, plain = start_gateway("plain", fast, extra)
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    edge_port, edge = start_gateway(
        "edge", fast,
        f"tls: {{ cert_file: {cert}, key_file: {key} }}\n"
        f"auth:\n  keys:\n    - {{ tenant: bench, key_sha256: {digest}, requests_per_second: 1000000, "
        f"burst: 1000000, tokens_per_minute: 1000000000000 }}\n{extra}", ca=ca)
    targets = [("direct", fast), ("plain", plain), ("edge", edge)]
    common = ["--api-key", KEY, "--ca-file", ca, "--prewarm-connections", "64"]

    rps, half, lat = base.measure(targets, rounds_n, duration, ["plain", "edge"], *common)

    hs_seconds, hs_rounds = (3, 1) if quick else (5, 3)
    hs = {"edge": base.median([handshakes_per_s(edge_port, hs_seconds) for _ in range(hs_rounds)])}
    ngx_port = start_nginx_tls(cert, key, fast) if shutil.which("nginx") else None
    if ngx_port:
        hs["nginx"] = base.median([handshakes_per_s(ngx_port, hs_seconds) for _ in range(hs_rounds)])

    print("\n## Cost of the edge features (TLS 1.3 + API key + limiters) on the same 2 cores\n")
    print("| figure | plain gateway | edge gateway | edge ÷ plain |")
    print("|---|---:|---:|---:|")
    print(f"| requests/s at saturation (64 concurrent keep-alive, 16 in / 16 out, streamed; median of {rounds_n}) | "
          f"{rps['plain']:.0f} | {rps['edge']:.0f} | {rps['edge'] / rps['plain']:.2f}× |")
    for m, label in [("e2e_ms", "e2e"), ("ttft_ms", "TTFT")]:
        for q in ["p50", "p99"]:
            p, e = base.added(lat, "plain", m, q), base.added(lat, "edge", m, q)
            print(f"| {label} {q} added over direct at {half:.0f} req/s, Poisson (ms) | {p:+.2f} | {e:+.2f} | "
                  f"{e - p:+.2f} ms |")
    line = f"| full TLS 1.3 handshakes/s (`openssl s_time -new`, P-256) | | {hs['edge']:.0f} |"
    if "nginx" in hs:
        line += f" nginx: {hs['nginx']:.0f} ({hs['edge'] / hs['nginx']:.2f}×) |"
    else:
        line += " |"
    print(line)
    print(f"\n(reports under {WORK})")
    bars = Bars()
    bars.check("edge ÷ plain requests/s (TLS, API key, limiters)", rps["edge"] / rps["plain"], ">=", 0.90, "×")
    return bars


if __name__ == "__main__":
    run(main, cleanup=base.kill_all)
