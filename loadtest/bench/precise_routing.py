#!/usr/bin/env python3
"""Precise prefix routing from engine KV events vs the approximate index, with 1, 2 and 4
gateway replicas, in one run (issue #19), with `switchyard-loadtest cluster`.

Cluster: six simulated H100 engines (Llama-3-8B timing) that tokenize with the real model's
tokenizer (`--tokenizer`, the SmolLM2 GGUF that scripts/setup.sh fetches) and a KV cache cut
with `--num-gpu-blocks-override` so that the prefix working set fits about twice: once, not
four times. Workload: shared-prefix (48 groups × a long system prompt + a question), Poisson
arrivals; the requests are spread over the gateway replicas in turn.

  approximate  each replica's own prefix index (what it routed itself); engines publish no events
  precise      engines publish KV events; every replica subscribes and tokenizes requests
               (kv_events.tokenizer), so all score by the blocks the engines really hold

Also a run with a cache too small for the working set (evictions), one replica, both modes;
and the SGLang model gateway (`smg` 1.13.0 from PyPI, its `cache_aware` policy, installed
under .cache/smg on first use) in front of the same engines, one replica, for the
single-gateway bar (warm-up diversion off: `--worker-warmup-secs 0`, a start-up artefact).

Prints per run: TTFT mean/p50/p90/p99, the engines' prefix-cache hit rate, the gateways' CPU
per request; then the bars. Bars (#19): with 4 replicas, precise mean TTFT ≤ 1.15× precise
with 1 replica and hit rate within 3 points of it; precise 4-replica mean TTFT ≤ 0.5×
approximate's; with evictions (1 replica) precise mean TTFT < approximate's; one replica:
precise `cost` mean TTFT ≤ smg's.
Exits 1 when a bar is missed, 2 when it could not measure.

Usage: python3 loadtest/bench/precise_routing.py [--quick] [--rate R] [--requests N] [--no-build]
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bars import Bars, SetupError, run  # noqa: E402
from prefix_routing import ttft_cdf_svg  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release")
WORK = os.path.join(ROOT, ".cache", "bench", "precise-routing")
MODEL = os.path.join(os.environ.get("SWITCHYARD_MODEL_DIR", os.path.join(ROOT, ".cache", "models")),
                     "SmolLM2-135M-Instruct.Q4_1.gguf")


SMG_VERSION = "1.13.0"
SMG_DIR = os.path.join(ROOT, ".cache", "smg")


def smg_command():
    """The --router command for smg, installing it first when missing."""
    stamp = os.path.join(SMG_DIR, ".version")
    if not (os.path.exists(stamp) and open(stamp).read() == SMG_VERSION):
        print(f"installing smg=={SMG_VERSION} into {SMG_DIR}")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--upgrade",
                        "--target", SMG_DIR, f"smg=={SMG_VERSION}"], check=True)
        with open(stamp, "w") as f:
            f.write(SMG_VERSION)
    return (f"env PYTHONPATH={SMG_DIR} {sys.executable} -m smg launch --host 127.0.0.1 --port {{port}} "
            "--worker-urls {workers} --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port {metrics_port} "
            "--worker-startup-check-interval 1 --worker-warmup-secs 0 --worker-warmup-divert-every 0 --log-level warn")


def cluster(name, precise, gateways, blocks, args, router=None):
    out = os.path.join(WORK, name)
    cmd = [f"{BIN}/switchyard-loadtest", "cluster", "--engines", str(args.engines), "--sim-profile", "h100-llama3-8b",
           "--policy", args.policy, "--gateways", str(gateways), "--tokenizer", MODEL,
           f"--engine-arg=--num-gpu-blocks-override={blocks}"]
    if precise:
        cmd.append("--kv-events")
    if router:
        cmd += ["--router", router, "--router-ready-path", "/readiness"]
    cmd += ["--", "--endpoint", "chat", "--seed", "1", "--out", out, "--workload", "shared-prefix",
            "--groups", str(args.groups), "--prefix-len", str(args.prefix_len), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--rate", str(args.rate), "--requests", str(args.requests),
            "--warmup", str(args.requests // 10)]
    if subprocess.run(cmd).returncode != 0:
        raise SetupError(f"switchyard-loadtest cluster failed ({name})")
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    t = s["targets"][0]
    if t["failed"]:
        raise SetupError(f"{name}: {t['failed']} requests failed (see {out})")
    c = s["config"]["cluster"]
    return {"ttft": t["ttft_ms"], "hit": c["prefix_cache_hit_rate"], "completed": t["completed"], "out": out,
            "cpu_ms": 1e3 * sum(c.get("gateway_cpu_s", [])) / max(1, t["completed"] + t["failed"]),
            "preemptions": sum(e["preemptions"] for e in c["engines"])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run, not the benchmark)")
    ap.add_argument("--no-build", action="store_true", help="use the release binaries already built")
    ap.add_argument("--engines", type=int, default=6)
    ap.add_argument("--policy", default="cost")
    ap.add_argument("--rate", type=float, default=25.0, help="requests/s (Poisson)")
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--groups", type=int, default=48)
    ap.add_argument("--prefix-len", type=int, default=3000, help="system prompt words×tokens as the loadtest counts")
    ap.add_argument("--input-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--blocks", type=int, help="KV blocks per engine (default: the working set fits ~2×)")
    ap.add_argument("--small-blocks", type=int, help="KV blocks per engine of the eviction run (default: ~0.5×)")
    ap.add_argument("--no-smg", action="store_true", help="skip the smg run (and its bar)")
    ap.add_argument("--only", help="comma list of runs (approximate-1, precise-4, approximate-evict, smg-1, …): a "
                    "partial run reports, and checks only the bars whose runs it has")
    args = ap.parse_args()
    if args.quick:
        args.requests = 200
    if not os.path.exists(MODEL):
        raise SetupError(f"{MODEL} is missing: run scripts/setup.sh")
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--locked", "-p", "switchyard-engine", "-p", "switchyard-gateway",
                        "-p", "switchyard-loadtest"], cwd=ROOT, check=True)
    os.makedirs(WORK, exist_ok=True)
    # The working set in 16-token blocks, counting ~1.3 real tokens per loadtest token (the
    # loadtest writes words; the real tokenizer splits some of them).
    working_set = int(args.groups * args.prefix_len * 1.3 / 16)
    per_engine = working_set / args.engines
    blocks = args.blocks or int(2.0 * per_engine + 600)
    small = args.small_blocks or int(0.5 * per_engine + 600)
    print(f"working set ≈ {working_set} blocks ({per_engine:.0f} per engine); {blocks} blocks per engine, "
          f"{small} in the eviction run")

    only = set(args.only.split(",")) if args.only else None
    wanted = lambda name: only is None or name in only  # noqa: E731
    rows = {}
    for replicas in (1, 2, 4):
        for precise in (False, True):
            mode = "precise" if precise else "approximate"
            if wanted(f"{mode}-{replicas}"):
                rows[(mode, replicas)] = cluster(f"{mode}-{replicas}", precise, replicas, blocks, args)
    for precise in (False, True):
        mode = "precise" if precise else "approximate"
        if wanted(f"{mode}-evict"):
            rows[(mode, "evict")] = cluster(f"{mode}-evict", precise, 1, small, args)
    if not args.no_smg and wanted("smg-1"):
        rows[("smg cache_aware", 1)] = cluster("smg-1", False, 1, blocks, args, router=smg_command())

    print(f"\n### {args.engines} engines, {args.groups} groups, {args.rate} req/s, policy {args.policy}\n")
    print("| router / index | replicas | KV blocks/engine | TTFT mean ms | p50 | p90 | p99 | prefix hit rate | preemptions | "
          "gateway CPU ms/request |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (mode, replicas), r in rows.items():
        b = small if replicas == "evict" else blocks
        label = "1 (evictions)" if replicas == "evict" else replicas
        t = r["ttft"]
        print(f"| {mode} | {label} | {b} | {t['mean']:.1f} | {t['p50']:.1f} | {t['p90']:.1f} | {t['p99']:.1f} | "
              f"{r['hit'] * 100:.1f}% | {r['preemptions']:.0f} | {r['cpu_ms']:.2f} |")
    curves = {f"{m} ×{r}": rows[(m, r)] for m in ("approximate", "precise") for r in (1, 4) if (m, r) in rows}
    if ("smg cache_aware", 1) in rows:
        curves["smg cache_aware ×1"] = rows[("smg cache_aware", 1)]
    if curves:
        ttft_cdf_svg("1 and 4 gateway replicas", curves, os.path.join(WORK, "replicas-ttft-cdf.svg"))
    print(f"\nreports under {WORK} (TTFT CDFs: replicas-ttft-cdf.svg)")

    bars = Bars()
    p1, p4, a4 = rows.get(("precise", 1)), rows.get(("precise", 4)), rows.get(("approximate", 4))
    if p1 and p4:
        bars.check("precise: 4-replica ÷ 1-replica mean TTFT", p4["ttft"]["mean"] / p1["ttft"]["mean"], "<=", 1.15,
                   "×")
        bars.check("precise: 1-replica − 4-replica hit rate (points)", (p1["hit"] - p4["hit"]) * 100, "<=", 3.0)
    if p4 and a4:
        bars.check("4 replicas: precise ÷ approximate mean TTFT", p4["ttft"]["mean"] / a4["ttft"]["mean"], "<=", 0.5,
                   "×")
    pe, ae = rows.get(("precise", "evict")), rows.get(("approximate", "evict"))
    if pe and ae:
        bars.check("evictions, 1 replica: precise ÷ approximate mean TTFT", pe["ttft"]["mean"] / ae["ttft"]["mean"],
                   "<", 1.0, "×")
    sm = rows.get(("smg cache_aware", 1))
    if sm and p1:
        bars.check("1 replica: cost (precise) ÷ smg cache_aware mean TTFT", p1["ttft"]["mean"] / sm["ttft"]["mean"],
                   "<=", 1.0, "×")
    if only is not None and not bars.rows:
        return None
    return bars


if __name__ == "__main__":
    run(main)
