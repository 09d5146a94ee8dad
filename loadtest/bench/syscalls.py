#!/usr/bin/env python3
"""System calls per proxied request: the gateway beside NGINX and Envoy, counted by `strace -c`.

One instant engine, each proxy in front of it with the configuration of
`gateway_vs_proxies.py` (the gateway with its defaults), and for each proxy in turn: strace
attached to every thread of the proxy's processes, N streamed 16-in / 16-out completions
through it (switchyard-loadtest, concurrency 8 on 8 keep-alive connections opened first),
strace detached. Prints each proxy's calls per request by system call (those at ≥ 0.1 per
request) and in all. strace slows the traced process many times over, so the counts (not the
times) are the figure.

Bars: none (the counts are reported, docs/performance.md). Exit status: 0 once counted, 2 when
it could not count (a setup error).

Usage: python3 loadtest/bench/syscalls.py [--kv-events] [REQUESTS]   (default 2000; `--kv-events`:
precise routing on, as in `gateway_vs_proxies.py --kv-events` — the gateway also follows the
engine's KV-event stream, and its calls for that are counted with the requests')
"""
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import procs  # noqa: E402
from procs import ROOT  # noqa: E402

procs.WORK = os.path.join(ROOT, ".cache", "bench", "syscalls")
PROXIES = ["nginx", "envoy", "gateway"]


def threads_of(pids):
    tids = []
    for pid in pids:
        tids += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return tids


def count(name, pids, url, n):
    """Calls by system call while `n` requests go through `url`, and the requests counted."""
    out = os.path.join(procs.WORK, f"strace-{name}.txt")
    cmd = ["strace", "-c", "-f", "-q", "-o", out]
    for tid in threads_of(pids):
        cmd += ["-p", str(tid)]
    tracer = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    x = procs.loadtest(f"load-{name}", [(name, url)], "--concurrency", "8", "--requests", str(n),
                       "--prewarm-connections", "8", "--timeout-s", "60")[name]
    tracer.send_signal(signal.SIGINT)
    tracer.wait(timeout=30)
    if x.get("failed", 0):
        raise procs.SetupError(f"{name}: {x['failed']} failed requests; see {procs.WORK}")
    calls = {}
    with open(out) as f:
        for line in f:
            # % time, seconds, usecs/call, calls, [errors,] syscall
            m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
            if m and m.group(2) != "total":
                calls[m.group(2)] = int(m.group(1))
    return calls, x.get("completed", n)


def main():
    args = sys.argv[1:]
    kv = "--kv-events" in args
    args = [a for a in args if a != "--kv-events"]
    n = int(args[0]) if args else 2000
    procs.prepare([("nginx", "nginx-light"), ("strace", "strace")])
    engine_args, events, line = ["--sim-profile", "instant"], None, ""
    if kv:
        extra, events, line = procs.kv_events_setup()
        engine_args += extra
    _, engine = procs.start_engine(*engine_args)
    servers, urls = {}, {}
    servers["nginx"], urls["nginx"] = procs.start_nginx("nginx", engine)
    servers["envoy"], urls["envoy"] = procs.start_envoy("envoy", engine)
    servers["gateway"], urls["gateway"] = procs.start_gateway("gateway", engine, line, kv_events=events)
    per = {}
    for name in PROXIES:
        p = servers[name]
        pids = procs.family(p.pid) if name == "nginx" else [p.pid]
        calls, done = count(name, pids, urls[name], n)
        per[name] = {k: v / done for k, v in calls.items()}
    names = sorted({k for v in per.values() for k, c in v.items() if c >= 0.1},
                   key=lambda k: -per["gateway"].get(k, 0))
    print(f"\n## System calls per request ({n} streamed 16/16 completions, concurrency 8, strace -c"
          f"{'; kv_events on' if kv else ''})\n")
    print("| system call | " + " | ".join(PROXIES) + " |")
    print("|---|" + "---:|" * len(PROXIES))
    for k in names:
        print(f"| {k} | " + " | ".join(f"{per[p].get(k, 0):.2f}" for p in PROXIES) + " |")
    totals = {p: sum(per[p].values()) for p in PROXIES}
    print("| **all** | " + " | ".join(f"**{totals[p]:.2f}**" for p in PROXIES) + " |")
    print(f"\ngateway ÷ nginx: {totals['gateway'] / totals['nginx']:.2f}×; "
          f"gateway ÷ envoy: {totals['gateway'] / totals['envoy']:.2f}×")
    print("bars: none (this benchmark reports figures only)")


if __name__ == "__main__":
    try:
        main()
    except procs.SetupError as e:
        print(f"setup error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        procs.kill_all()
