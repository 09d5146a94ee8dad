#!/usr/bin/env python3
"""Prefix-aware routing on a simulated 8 × H100 cluster: round_robin vs least_load vs
prefix_affinity vs cost, in one run, with `switchyard-loadtest cluster`.

Workloads (issue #5):
  shared-prefix  32 groups × a 4,000-token shared prefix + 200-token questions, 256 output
                 tokens, Poisson arrivals at RATE (default ≈ 70% of the cluster's capacity)
  no-prefix      independent 4,200-token prompts, same arrivals (cost must not regress)
  multi-turn     conversations re-sending their history

Prints, per workload and policy: TTFT p50/p90/p99, ITL p50/p99, output tokens/s, the
engines' aggregate prefix-cache hit rate; then the bars' ratios.
Usage: python3 loadtest/bench/prefix_routing.py [--quick] [--rate R] [--requests N]
"""
import argparse
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release")
WORK = os.path.join(ROOT, ".cache", "bench", "prefix-routing")
POLICIES = ["round_robin", "least_load", "prefix_affinity", "cost"]


def cluster(name, policy, engines, workload_args):
    out = os.path.join(WORK, f"{name}-{policy}")
    cmd = [f"{BIN}/switchyard-loadtest", "cluster", "--engines", str(engines), "--sim-profile", "h100-llama3-8b",
           "--policy", policy, "--", "--endpoint", "chat", "--seed", "1", "--out", out, *workload_args]
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    t = s["targets"][0]
    return {
        "ttft": t["ttft_ms"], "itl": t["itl_ms"], "otps": t["output_tokens_per_s"],
        "hit": s["config"]["cluster"]["prefix_cache_hit_rate"], "failed": t["failed"],
    }


def table(name, rows):
    print(f"\n### {name}\n")
    print("| policy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s | prefix hit rate | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p, r in rows.items():
        print(f"| {p} | {r['ttft']['p50']:.0f} | {r['ttft']['p90']:.0f} | {r['ttft']['p99']:.0f} | {r['itl']['p50']:.1f} | "
              f"{r['itl']['p99']:.1f} | {r['otps']:.0f} | {r['hit'] * 100:.1f}% | {r['failed']} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run, not the benchmark)")
    ap.add_argument("--rate", type=float, default=10.0, help="requests/s (≈70%% of 8 simulated H100s)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--workloads", default="shared-prefix,no-prefix,multi-turn", help="comma list")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list")
    args = ap.parse_args()
    n = 200 if args.quick else args.requests
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "switchyard-engine", "-p", "switchyard-gateway",
                    "-p", "switchyard-loadtest"], cwd=ROOT, check=True)
    os.makedirs(WORK, exist_ok=True)
    common = ["--rate", str(args.rate), "--requests", str(n), "--warmup", str(n // 20), "--output-len", "256"]
    workloads = {
        "shared-prefix": ["--workload", "shared-prefix", "--groups", "32", "--prefix-len", "4000", "--input-len", "200", *common],
        "no-prefix": ["--workload", "synthetic", "--input-len", "4200", *common],
        "multi-turn": ["--workload", "multi-turn", "--turns", "6", "--think-time-s", "2", "--input-len", "400", *common],
    }
    results = {}
    chosen = args.policies.split(",")
    for w in args.workloads.split(","):
        policies = [p for p in chosen if p in ("least_load", "cost")] if w == "no-prefix" else chosen
        results[w] = {p: cluster(w, p, args.engines, workloads[w]) for p in policies}
        table(w, results[w])

    need = {"shared-prefix": ["round_robin", "least_load", "cost"], "no-prefix": ["least_load", "cost"]}
    if any(w not in results or any(p not in results[w] for p in ps) for w, ps in need.items()):
        print(f"\n(bars need shared-prefix and no-prefix with round_robin, least_load, cost; reports under {WORK})")
        return
    sp, npf = results["shared-prefix"], results["no-prefix"]
    r_rr = sp["cost"]["ttft"]["p90"] / sp["round_robin"]["ttft"]["p90"]
    r_ll = sp["cost"]["ttft"]["p90"] / sp["least_load"]["ttft"]["p90"]
    thr = sp["cost"]["otps"] / sp["round_robin"]["otps"]
    nop = npf["cost"]["ttft"]["p90"] / npf["least_load"]["ttft"]["p90"]
    print("\n| bar | measured | met |")
    print("|---|---:|---|")
    print(f"| cost TTFT p90 ≤ 0.5× round_robin (shared prefix) | {r_rr:.2f}× | {'yes' if r_rr <= 0.5 else 'NO'} |")
    print(f"| cost TTFT p90 ≤ 0.8× least_load (shared prefix) | {r_ll:.2f}× | {'yes' if r_ll <= 0.8 else 'NO'} |")
    print(f"| cost output tok/s ≥ round_robin (shared prefix) | {thr:.2f}× | {'yes' if thr >= 1.0 else 'NO'} |")
    print(f"| cost TTFT p90 within 5% of least_load (no prefix) | {nop:.2f}× | {'yes' if nop <= 1.05 else 'NO'} |")
    print(f"\nreports under {WORK}")


if __name__ == "__main__":
    main()
