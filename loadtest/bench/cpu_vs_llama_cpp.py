#!/usr/bin/env python3
"""The engine's cpu backend vs llama.cpp's llama-server, same model file, same two cores, one run.

Both serve SmolLM2-135M-Instruct Q4_1 (`.cache/models`, fetched by scripts/setup.sh); the
anchor is built by scripts/build-llama-cpp.sh (llama.cpp vendored in the llama-cpp-python
sdist). Both servers are up at once but only one is loaded at a time, each with 2 threads and 16
slots/sequences; rounds alternate between them (median of 3). Measured with
switchyard-loadtest over the OpenAI completions API:

1. single-stream decode: 1 stream, 16-token prompt, 128 output tokens → 1000 / mean ITL;
2. prompt processing: 1 stream, 512-token prompt, 1 output token → prompt tokens / TTFT;
3. aggregate: 16 concurrent streams, 64-token prompts, 128 output tokens → output tokens/s.

Bars (issue #6): single-stream decode ≥ 0.7× llama.cpp, prompt processing ≥ 1.0×, aggregate
≥ 1.0×. Prints the figures, then each bar with its measured ratio; exits 1 when a bar is
missed, 2 when it could not measure (a setup error).
Usage: python3 loadtest/bench/cpu_vs_llama_cpp.py [--quick]
"""
import json
import os
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
LLAMA = os.path.join(ROOT, ".cache", "llama.cpp", "build", "bin")
MODEL = os.path.join(ROOT, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
WORK = os.path.join(ROOT, ".cache", "bench", "cpu-vs-llama-cpp")
QUICK = "--quick" in sys.argv
REPS = 1 if QUICK else 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.2)
    raise SetupError(f"{url} did not become ready")


def serve(name):
    port = free_port()
    log = open(os.path.join(WORK, f"{name}.log"), "w")
    if name == "switchyard":
        cmd = [f"{BIN}/switchyard-engine", "--backend", "cpu", "--model", MODEL, "--served-model-name", "smollm2",
               "--host", "127.0.0.1", "--port", str(port), "--threads", "2", "--max-num-seqs", "16",
               "--kv-cache-space", "1"]
    else:
        cmd = [f"{LLAMA}/llama-server", "-m", MODEL, "--host", "127.0.0.1", "--port", str(port), "-t", "2",
               "-np", "16", "-c", str(16 * 2048), "--alias", "smollm2"]
    p = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True,
                         env={**os.environ, "LD_LIBRARY_PATH": LLAMA})
    wait_ready(f"http://127.0.0.1:{port}/v1/models")
    return p, f"http://127.0.0.1:{port}"


def loadtest(name, url, out, *args, seed=1, work=None):
    # A fresh seed per round: the prompts must not be in either server's prompt cache.
    d = os.path.join(work or WORK, f"{name}-{out}")
    cmd = [f"{BIN}/switchyard-loadtest", "run", "--endpoint", "completions", "--model", "smollm2", "--seed", str(seed),
           "--target", f"{name}={url}", "--out", d, *args]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SetupError(f"switchyard-loadtest failed against {name}:\n{done.stderr[-2000:]}")
    with open(os.path.join(d, "summary.json")) as f:
        return json.load(f)["targets"][0]


def one_round(name, url, r):
    t = loadtest(name, url, f"single-{r}", "--concurrency", "1", "--requests", "3", "--input-len", "16",
                 "--output-len", "128", seed=100 + r)
    single = 1000.0 / t["itl_ms"]["mean"]
    t = loadtest(name, url, f"prompt-{r}", "--concurrency", "1", "--requests", "3", "--input-len", "512",
                 "--output-len", "1", seed=200 + r)
    prompt = 512 / (t["ttft_ms"]["p50"] / 1000.0)
    t = loadtest(name, url, f"agg-{r}", "--concurrency", "16", "--requests", "48", "--input-len", "64",
                 "--output-len", "128", seed=300 + r)
    return {"single": single, "prompt": prompt, "aggregate": t["output_tokens_per_s"]}


def measure_both():
    """Both servers up (the idle one sleeps); rounds alternate so drift on this shared VM hits both."""
    servers = {name: serve(name) for name in ["switchyard", "llama.cpp"]}
    try:
        for name, (_, url) in servers.items():
            loadtest(name, url, "warmup", "--concurrency", "1", "--requests", "2", "--input-len", "16",
                     "--output-len", "16")
        rounds = {name: [] for name in servers}
        for r in range(REPS):
            for name, (_, url) in servers.items():
                rounds[name].append(one_round(name, url, r))
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        return {name: {k: med([x[k] for x in rs]) for k in ["single", "prompt", "aggregate"]}
                for name, rs in rounds.items()}
    finally:
        for p, _ in servers.values():
            os.killpg(p.pid, signal.SIGTERM)
            p.wait()


def main():
    if not os.path.exists(MODEL):
        raise SetupError(f"{MODEL} is missing: run scripts/setup.sh")
    if not os.path.exists(f"{LLAMA}/llama-server"):
        subprocess.run([os.path.join(ROOT, "scripts", "build-llama-cpp.sh")], check=True)
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "switchyard-engine", "-p", "switchyard-loadtest"],
                   cwd=ROOT, check=True)
    os.makedirs(WORK, exist_ok=True)
    both = measure_both()
    ours, theirs = both["switchyard"], both["llama.cpp"]
    print("\n## cpu backend vs llama.cpp (SmolLM2-135M-Instruct Q4_1, 2 threads, same 2 cores)\n")
    print(f"| figure (median of {REPS}) | switchyard | llama.cpp | ratio | bar |")
    print("|---|---:|---:|---:|---|")
    bars = {"single": 0.7, "prompt": 1.0, "aggregate": 1.0}
    labels = {"single": "single-stream decode, tokens/s", "prompt": "prompt processing (512-token TTFT), tokens/s",
              "aggregate": "16 concurrent streams, output tokens/s"}
    result = Bars()
    for k in ["single", "prompt", "aggregate"]:
        ratio = ours[k] / theirs[k]
        result.check(f"switchyard ÷ llama.cpp, {labels[k]}", ratio, ">=", bars[k], "×")
        print(f"| {labels[k]} | {ours[k]:.0f} | {theirs[k]:.0f} | {ratio:.2f}× | ≥ {bars[k]}× |")
    print(f"\n(reports under {WORK})")
    return result


if __name__ == "__main__":
    run(main)
