#!/usr/bin/env python3
"""Normal requests' latency through the gateway with and without a slowloris attack, in one run.

Upstream: one `switchyard-engine --sim-profile h100-llama3-8b`. The gateway's header deadline
is 1 s (`limits.header_read_timeout_ms: 1000`). The attack keeps 2,000 connections open, each
trickling one header byte every 300 ms; the gateway closes each at its deadline and the
attacker opens it again at once, so the pressure stays constant while normal requests (16
tokens, not streamed, a new connection each, one at a time) are timed. Rounds alternate
without and with the attack (3 of each); the figure is the ratio of the medians.

Bar (RELIABILITY.md case 9: slow clients do not slow others): median latency under attack
≤ 1.10× the median without. The end-to-end test
(`slow_clients_are_cut_off_without_slowing_others`) checks the behaviour with a wide margin;
this is the measurement. Exits 1 when the bar is missed, 2 when it could not measure.
Usage: python3 loadtest/bench/slowloris.py [--quick] [--connections N]
"""
import argparse
import asyncio
import http.client
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import procs as base  # noqa: E402  (shared process helpers)
from bars import Bars, SetupError, run  # noqa: E402

ROOT = base.ROOT
BIN = base.BIN
WORK = os.path.join(ROOT, ".cache", "bench", "slowloris")
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def start_gateway(engine_url):
    port, admin = base.free_port(), base.free_port()
    cfg = os.path.join(WORK, "gateway.yaml")
    with open(cfg, "w") as f:
        f.write(f"listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\nthreads: 2\n"
                f"discovery:\n  static:\n    - url: {engine_url}\npolicy: {{ type: least_load }}\n"
                "limits: { header_read_timeout_ms: 1000, body_read_timeout_ms: 1000 }\n")
    log = open(os.path.join(WORK, "gateway.log"), "w")
    base.spawn([f"{BIN}/switchyard-gateway", "--config", cfg], stdout=log, stderr=log,
               env={**os.environ, "RUST_LOG": "warn"})
    base.wait_http(f"http://127.0.0.1:{port}/-/ready")
    return port


def timed_requests(port, n):
    """Latencies (s) of `n` completions sent one after another, each on a new connection."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 16, "ignore_eos": True})
    out = []
    for _ in range(n):
        t = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        text = r.read()
        c.close()
        if r.status != 200:
            raise SetupError(f"a normal request got {r.status}: {text[:300]!r}")
        out.append(time.perf_counter() - t)
    return out


class Attack:
    """`n` slowloris connections, each reopened as soon as the gateway closes it."""

    def __init__(self, port, n):
        self.port, self.n = port, n
        self.closed_by_gateway = 0
        self.loop = asyncio.new_event_loop()
        self.stop = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.main(),), daemon=True)

    async def one(self):
        while not self.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            try:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nX-Slow: ")
                await writer.drain()
                while not self.stop.is_set():
                    try:
                        data = await asyncio.wait_for(reader.read(64), 0.3)
                    except asyncio.TimeoutError:
                        writer.write(b"a")
                        await writer.drain()
                        continue
                    if not data:
                        self.closed_by_gateway += 1
                        break
            except OSError:
                self.closed_by_gateway += 1
            finally:
                writer.close()

    async def main(self):
        self.stop = asyncio.Event()
        self.ready.set()
        await asyncio.gather(*(self.one() for _ in range(self.n)))

    def __enter__(self):
        self.ready = threading.Event()
        self.thread.start()
        self.ready.wait()
        time.sleep(1.0)  # connections opened and trickling
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=30)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 15 requests (a smoke run)")
    ap.add_argument("--connections", type=int, default=2000)
    args = ap.parse_args()
    rounds_n, per_round = (1, 15) if args.quick else (3, 40)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.connections + 256
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise SetupError(f"{args.connections} connections need {need} file descriptors; the limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "switchyard-engine", "-p", "switchyard-gateway"],
                   cwd=ROOT, check=True)
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    _, engine = base.start_engine("--sim-profile", "h100-llama3-8b")
    port = start_gateway(engine)
    timed_requests(port, 5)  # warm-up
    calm, attacked, closed = [], [], 0
    for _ in range(rounds_n):
        calm += timed_requests(port, per_round)
        with Attack(port, args.connections) as attack:
            attacked += timed_requests(port, per_round)
        closed += attack.closed_by_gateway
    m0, m1 = statistics.median(calm), statistics.median(attacked)
    print(f"\n## Normal requests under a slowloris attack ({args.connections} connections, 1 s header deadline)\n")
    print("| figure | without | with | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| median latency of a 16-token completion (ms; {len(calm)} requests each) | {m0 * 1e3:.1f} | "
          f"{m1 * 1e3:.1f} | {m1 / m0:.2f}× |")
    print(f"| p90 (ms) | {statistics.quantiles(calm, n=10)[-1] * 1e3:.1f} | "
          f"{statistics.quantiles(attacked, n=10)[-1] * 1e3:.1f} | |")
    print(f"\nslowloris connections closed by the gateway: {closed} (reports under {WORK})")
    if closed == 0:
        raise SetupError("the gateway closed no slowloris connection: the attack did not run")
    bars = Bars()
    bars.check("median latency with ÷ without the attack", m1 / m0, "<=", 1.10, "×")
    return bars


if __name__ == "__main__":
    run(main, cleanup=base.kill_all)
