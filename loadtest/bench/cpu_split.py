#!/usr/bin/env python3
"""Where a proxy's requests/s goes on a shared machine: NGINX and the gateway (and optionally a
second gateway build) in front of the same `instant` engine, alternating `wrk` rounds, each
round's requests/s and the CPU per request of every process taking part.

The proxy benchmark (`gateway_vs_proxies.py`) reports medians of rounds; on a 2-core VM
whose speed moves between rounds that cannot resolve a few percent. This prints every round
side by side (the round-by-round ratio is the figure to read), and per request: the engine's,
the proxy's and wrk's CPU (user + system, µs, from /proc and wrk's rusage) and the share of
the machine left idle. A proxy that costs the *other* processes more (cache pressure, extra
wakeups) shows up there, not in its own CPU time.

Bars: none (a diagnostic; docs/performance.md reads its output). Exit status: 0 once measured,
2 when it could not measure.

Usage: python3 loadtest/bench/cpu_split.py [--rounds N] [--seconds S] [--gateway-bin PATH]
       [--other-gateway-bin PATH] [--gateway-config YAML] [--other-gateway-config YAML]
       [--kv-events]
       (default: 5 rounds of 6 s, the dist gateway; `--kv-events`: precise routing on, as in
       `gateway_vs_proxies.py --kv-events` — the engine tokenizes and publishes KV events, every
       gateway subscribes and tokenizes each request)
"""
import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gateway_vs_proxies  # noqa: E402
import procs  # noqa: E402
from bars import run  # noqa: E402
from procs import ROOT, median  # noqa: E402

procs.WORK = os.path.join(ROOT, ".cache", "bench", "cpu-split")


def idle_and_total():
    """The machine's idle and total jiffies so far."""
    with open("/proc/stat") as f:
        x = [int(v) for v in f.readline().split()[1:]]
    return x[3] + x[4], sum(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--gateway-bin", default=None, help="the gateway to measure (default: the dist build)")
    ap.add_argument("--other-gateway-bin", default=None, help="a second gateway build, measured alongside")
    ap.add_argument("--gateway-config", default="", help="lines added to the gateway's config")
    ap.add_argument("--other-gateway-config", default="", help="lines added to the second gateway's config")
    ap.add_argument("--kv-events", action="store_true", help="precise routing on (engine KV events, tokenizing)")
    args = ap.parse_args()
    procs.prepare([("nginx", "nginx-light"), ("wrk", "wrk")])
    binary = args.gateway_bin or gateway_vs_proxies.build_dist_gateway()
    engine_args, events, line = ["--sim-profile", "instant"], None, ""
    if args.kv_events:
        extra, events, line = procs.kv_events_setup()
        engine_args += extra
    engine, fast = procs.start_engine(*engine_args)
    body = gateway_vs_proxies.completion_body(fast)
    servers, urls = {}, {}
    servers["nginx"], urls["nginx"] = procs.start_nginx("nginx", fast)
    servers["gateway"], urls["gateway"] = procs.start_gateway(
        "gateway", fast, f"{args.gateway_config}\n{line}", binary, events)
    if args.other_gateway_bin:
        servers["other"], urls["other"] = procs.start_gateway(
            "other", fast, f"{args.other_gateway_config}\n{line}", args.other_gateway_bin, events)
    targets = [("direct", fast)] + [(n, urls[n]) for n in servers]
    rows = {name: [] for name, _ in targets}
    for _ in range(args.rounds):
        for name, url in targets:
            proxy = gateway_vs_proxies.pids_of(name, servers[name]) if name in servers else []
            e0, p0 = procs.cpu_seconds([engine.pid]), procs.cpu_seconds(proxy)
            w0, i0 = resource.getrusage(resource.RUSAGE_CHILDREN), idle_and_total()
            t0 = time.time()
            rps = procs.wrk(url, body, 64, args.seconds)
            n = rps * (time.time() - t0)
            e1, p1 = procs.cpu_seconds([engine.pid]), procs.cpu_seconds(proxy)
            w1, i1 = resource.getrusage(resource.RUSAGE_CHILDREN), idle_and_total()
            us = lambda a, b: (sum(b) - sum(a)) / n * 1e6  # noqa: E731
            wrk_us = (w1.ru_utime - w0.ru_utime + w1.ru_stime - w0.ru_stime) / n * 1e6
            idle = (i1[0] - i0[0]) / max(1, i1[1] - i0[1])
            rows[name].append((rps, us(e0, e1), us(p0, p1), wrk_us, idle))
    print("requests/s by round (wrk, 64 connections):")
    for name, r in rows.items():
        print(f"  {name:8}", " ".join(f"{x[0]:7.0f}" for x in r))
    for name in servers:
        if name != "nginx":
            ratios = [g[0] / x[0] for g, x in zip(rows[name], rows["nginx"])]
            print(f"  {name} ÷ nginx by round:", " ".join(f"{x:.2f}" for x in ratios))
    print("\nmedians | req/s | engine µs/req | proxy µs/req | wrk µs/req | idle")
    for name, r in rows.items():
        c = list(zip(*r))
        print(f"  {name:8} | {median(c[0]):7.0f} | {median(c[1]):6.1f} | {median(c[2]):6.1f} | "
              f"{median(c[3]):6.1f} | {100 * median(c[4]):4.1f}%")


if __name__ == "__main__":
    run(main, procs.kill_all)
