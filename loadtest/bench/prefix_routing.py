#!/usr/bin/env python3
"""Prefix-aware routing on a simulated 8 × H100 cluster: round_robin vs least_load vs
prefix_affinity vs cost, in one run, with `switchyard-loadtest cluster`.

Capacity: unless --rate is given, each workload first runs with round_robin offered far more
than the cluster carries (--probe-rate, default 120 req/s); the completed requests/s is that
workload's capacity, and the workload then runs at 70% of it. On shared-prefix every policy
gets the same saturating run: that is the throughput comparison (below saturation an open
loop completes whatever is offered, whatever the policy). On the 2-core development machine
the simulated GPUs and the CPU that drives them saturate together on shared-prefix (~60 req/s,
~16k output tokens/s); no-prefix saturates the simulated prefill first.

Workloads (issue #5):
  shared-prefix  32 groups × a 4,000-token shared prefix + 200-token questions, 256 output
                 tokens, Poisson arrivals at RATE (default 70% of the measured capacity)
  no-prefix      independent 4,200-token prompts (cost must not regress against least_load)
  multi-turn     conversations of 6 turns re-sending their history (400-token turns, 2 s
                 think time), at the shared-prefix request rate (conversations/s = rate / 6)

Prints, per workload and policy: TTFT p50/p90/p99, ITL p50/p99, output tokens/s, the
engines' aggregate prefix-cache hit rate; then the bars' ratios. Writes one TTFT CDF per
workload with every policy on it (`<workload>-ttft-cdf.svg` under the work directory).
Bars (issue #5): on shared-prefix, cost TTFT p90 ≤ 0.5× round_robin's and ≤ 0.8× least_load's,
cost requests/s at saturation ≥ round_robin's; on no-prefix, cost TTFT p90 ≤ 1.05×
least_load's. Exits 1 when a bar is missed, 2 when it could not measure (a setup error); a
run narrowed by --workloads/--policies so that the bars have nothing to compare only reports
(exit 0).
Usage: python3 loadtest/bench/prefix_routing.py [--quick] [--rate R] [--requests N]
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
WORK = os.path.join(ROOT, ".cache", "bench", "prefix-routing")
POLICIES = ["round_robin", "least_load", "prefix_affinity", "cost"]
TURNS = 6


def cluster(name, policy, engines, workload_args):
    out = os.path.join(WORK, f"{name}-{policy}")
    cmd = [f"{BIN}/switchyard-loadtest", "cluster", "--engines", str(engines), "--sim-profile", "h100-llama3-8b",
           "--policy", policy, "--", "--endpoint", "chat", "--seed", "1", "--out", out, *workload_args]
    if subprocess.run(cmd).returncode != 0:
        raise SetupError(f"switchyard-loadtest cluster failed ({name}, {policy})")
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    t = s["targets"][0]
    return {
        "ttft": t["ttft_ms"], "itl": t["itl_ms"], "otps": t["output_tokens_per_s"],
        "hit": s["config"]["cluster"]["prefix_cache_hit_rate"], "failed": t["failed"],
        "rps": t["requests_per_s"], "out": out,
    }


def ttft_cdf_svg(name, rows, path):
    """One TTFT CDF with a line per policy, x on a log scale (1 ms .. the slowest request)."""
    import math
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    series = {}
    for p, r in rows.items():
        with open(os.path.join(r["out"], "requests.jsonl")) as f:
            xs = sorted(json.loads(line)["ttft_ms"] for line in f if line.strip())
        series[p] = [x for x in xs if x is not None and x > 0]
    hi = max(max(v) for v in series.values() if v)
    w, h, left, bottom = 640, 400, 60, 40
    lo_log, hi_log = 0.0, float(math.ceil(math.log10(max(hi, 10.0))))

    def px(ms):
        return left + (math.log10(max(ms, 1.0)) - lo_log) / (hi_log - lo_log) * (w - left - 20)

    def py(q):
        return h - bottom - q * (h - bottom - 30)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{w / 2}" y="18" text-anchor="middle">TTFT CDF — {name}</text>']
    for d in range(0, int(hi_log) + 1):
        x = px(10 ** d)
        out.append(f'<line x1="{x:.1f}" y1="{py(0)}" x2="{x:.1f}" y2="{py(1)}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{h - bottom + 16}" text-anchor="middle">{10 ** d:g} ms</text>')
    for q in [0, 0.5, 0.9, 0.99, 1.0]:
        out.append(f'<line x1="{left}" y1="{py(q):.1f}" x2="{w - 20}" y2="{py(q):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{py(q) + 4:.1f}" text-anchor="end">{q:g}</text>')
    for i, (p, xs) in enumerate(series.items()):
        n = len(xs)
        pts = " ".join(f"{px(x):.1f},{py((k + 1) / n):.1f}" for k, x in enumerate(xs))
        c = colors[i % len(colors)]
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{pts}"/>')
        out.append(f'<text x="{left + 10}" y="{40 + 16 * i}" fill="{c}">{p}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


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
    ap.add_argument("--rate", type=float, help="requests/s (default: 70%% of the measured capacity)")
    ap.add_argument("--probe-rate", type=float, default=120.0, help="offered rate of the capacity probe")
    ap.add_argument("--multi-turn-rate", type=float, help="conversations/s (default: the shared-prefix rate / turns)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--no-build", action="store_true", help="use the release binaries already built")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--workloads", default="shared-prefix,no-prefix,multi-turn", help="comma list")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list")
    args = ap.parse_args()
    n = 200 if args.quick else args.requests
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--locked", "-p", "switchyard-engine", "-p", "switchyard-gateway",
                        "-p", "switchyard-loadtest"], cwd=ROOT, check=True)
    os.makedirs(WORK, exist_ok=True)
    shape = {
        "shared-prefix": ["--workload", "shared-prefix", "--groups", "32", "--prefix-len", "4000", "--input-len", "200"],
        "no-prefix": ["--workload", "synthetic", "--input-len", "4200"],
        "multi-turn": ["--workload", "multi-turn", "--turns", str(TURNS), "--think-time-s", "2", "--input-len", "400"],
    }
    chosen = args.policies.split(",")
    probe_n = 300 if args.quick else 1200

    def probe(w, policy):
        return cluster(f"saturation-{w}", policy, args.engines,
                       [*shape[w], "--output-len", "256", "--rate", str(args.probe_rate), "--requests", str(probe_n),
                        "--warmup", "0"])

    # Capacity of each workload: round_robin offered --probe-rate (past saturation), completed
    # requests/s. The workload then runs at 70% of it. On shared-prefix every policy is also
    # saturated: that is the throughput comparison (in an open loop below saturation every
    # policy completes what is offered).
    saturation, rates = {}, {}
    for w in [w for w in args.workloads.split(",") if w != "multi-turn"]:
        policies = chosen if w == "shared-prefix" else ["round_robin"]
        saturation[w] = {p: probe(w, p) for p in policies if args.rate is None or w == "shared-prefix"}
        if args.rate is not None:
            rates[w] = args.rate
        else:
            cap = saturation[w]["round_robin"]["rps"]
            rates[w] = round(0.7 * cap, 1)
            print(f"\ncapacity of {w}: {cap:.1f} req/s completed with {args.probe_rate:.0f} req/s offered to "
                  f"round_robin; runs at 70% = {rates[w]} req/s")
    # Multi-turn arrivals are conversations of TURNS requests each, and think times pace them,
    # so an overload probe says little. They run at the shared-prefix request rate (similar
    # prompt lengths): conversations/s = that rate / TURNS.
    if "multi-turn" in args.workloads.split(","):
        if args.multi_turn_rate is not None:
            rates["multi-turn"] = args.multi_turn_rate
        else:
            if "shared-prefix" not in rates:
                cap = probe("shared-prefix", "round_robin")["rps"]
                rates["shared-prefix"] = round(0.7 * cap, 1)
            rates["multi-turn"] = round(rates["shared-prefix"] / TURNS, 2)
        print(f"\nmulti-turn: {rates['multi-turn']} conversations/s of {TURNS} turns")
    if "shared-prefix" in saturation:
        print("\n### shared-prefix at saturation\n")
        print(f"| policy | completed req/s ({args.probe_rate:.0f} offered) | output tok/s | TTFT p50 ms | prefix hit rate |")
        print("|---|---:|---:|---:|---:|")
        for p, r in saturation["shared-prefix"].items():
            print(f"| {p} | {r['rps']:.1f} | {r['otps']:.0f} | {r['ttft']['p50']:.0f} | {r['hit'] * 100:.1f}% |")

    def workload_args(w):
        return [*shape[w], "--rate", str(rates[w]), "--requests", str(n), "--warmup", str(n // 20), "--output-len", "256"]

    results = {}
    for w in args.workloads.split(","):
        policies = [p for p in chosen if p in ("least_load", "cost")] if w == "no-prefix" else chosen
        results[w] = {p: cluster(w, p, args.engines, workload_args(w)) for p in policies}
        table(f"{w} at {rates[w]} req/s", results[w])
        ttft_cdf_svg(w, results[w], os.path.join(WORK, f"{w}-ttft-cdf.svg"))

    need = {"shared-prefix": ["round_robin", "least_load", "cost"], "no-prefix": ["least_load", "cost"]}
    print(f"\nreports under {WORK}")
    bars = Bars()
    if any(w not in results or any(p not in results[w] for p in ps) for w, ps in need.items()):
        print("\n(the bars need shared-prefix and no-prefix with round_robin, least_load and cost)")
        return None
    sp, npf = results["shared-prefix"], results["no-prefix"]
    bars.check("cost ÷ round_robin TTFT p90 (shared prefix)",
               sp["cost"]["ttft"]["p90"] / sp["round_robin"]["ttft"]["p90"], "<=", 0.5, "×")
    bars.check("cost ÷ least_load TTFT p90 (shared prefix)",
               sp["cost"]["ttft"]["p90"] / sp["least_load"]["ttft"]["p90"], "<=", 0.8, "×")
    sat = saturation.get("shared-prefix", {})
    if "cost" in sat and "round_robin" in sat:
        bars.check("cost ÷ round_robin requests/s at saturation (shared prefix)",
                   sat["cost"]["rps"] / sat["round_robin"]["rps"], ">=", 1.0, "×")
    else:
        print("(no saturation runs with --rate: the throughput bar is not measured)")
    bars.check("cost ÷ least_load TTFT p90 (no prefix)",
               npf["cost"]["ttft"]["p90"] / npf["least_load"]["ttft"]["p90"], "<=", 1.05, "×")
    return bars


if __name__ == "__main__":
    run(main)
