#!/usr/bin/env python3
"""Constrained decoding's cost per generated token: the same engine, the same kind of
prompt, with and without a JSON schema, one run.

One cpu engine (release build, SmolLM2-135M-Instruct Q4_1, 2 threads) serves streamed chat
requests one at a time — a single sequence, where the per-step grammar work (computing the
allowed-token mask with llguidance, masking 49,152 logits, feeding the token back) is the
largest share of a step it can be. Rounds alternate between

  free:        96 tokens, `ignore_eos` (no grammar);
  constrained: `response_format` json_schema — an object with a list of 8 strings of at most
               40 characters, and an integer in 0..=3000 (about 30–110 tokens);

and the time per output token is (last chunk − first content chunk) ÷ (tokens − 1), so the
prefill is left out. Medians over the rounds.

Bar (issue #22): constrained ÷ free time per token ≤ 1.10.
Exits 0 when met, 1 when missed, 2 on a setup error. Usage:
  python3 loadtest/bench/constrained_decoding.py [--quick]
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bars import Bars, SetupError, run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = os.path.join(ROOT, "target", "release", "switchyard-engine")
MODEL = os.path.join(ROOT, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
ROUNDS = 4 if "--quick" in sys.argv else 12
SCHEMA = {
    "type": "object",
    "properties": {
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 8, "maxItems": 8},
        "year": {"type": "integer", "minimum": 0, "maximum": 3000},
    },
    "required": ["topics", "year"],
    "additionalProperties": False,
}
procs = []


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine():
    if not os.path.exists(ENGINE):
        raise SetupError(f"{ENGINE} is missing: cargo build --release -p switchyard-engine")
    if not os.path.exists(MODEL):
        raise SetupError(f"{MODEL} is missing: run scripts/setup.sh")
    port = free_port()
    p = subprocess.Popen([ENGINE, "--backend", "cpu", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
                          "--threads", "2", "--max-model-len", "2048"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    procs.append(p)
    url = f"http://127.0.0.1:{port}"
    end = time.time() + 120
    while time.time() < end:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                return url
        except Exception:
            time.sleep(0.2)
    raise SetupError("the engine did not come up")


def per_token(url, body):
    """Seconds per output token after the first, and the output token count."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    first = last = None
    tokens = 0
    text = ""
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            for c in ev.get("choices", []):
                piece = c["delta"].get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text += piece
    if tokens < 2 or first is None:
        raise SetupError(f"too short an answer: {tokens} tokens")
    return (last - first) / (tokens - 1), tokens, text


def main():
    bars = Bars()
    url = start_engine()
    free, constrained, lengths = [], [], []
    for i in range(ROUNDS + 1):
        ask = [{"role": "user", "content": f"List eight topics about history, set {i}, as JSON."}]
        f, _, _ = per_token(url, {"messages": ask, "max_tokens": 96, "ignore_eos": True, "temperature": 0.7,
                                  "seed": i})
        c, n, text = per_token(url, {"messages": ask, "max_tokens": 400, "temperature": 0.7, "seed": i,
                                     "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "t", "schema": SCHEMA}}})
        doc = json.loads(text)
        if len(doc["topics"]) != 8:
            raise SetupError(f"the constrained answer does not follow the schema: {text}")
        if i == 0:
            continue  # warm-up (the grammar compiler is built on the first constrained request)
        free.append(f)
        constrained.append(c)
        lengths.append(n)
    mf, mc = statistics.median(free), statistics.median(constrained)
    print(f"rounds: {ROUNDS} (alternating), single stream, SmolLM2-135M-Instruct Q4_1 on the cpu backend, 2 threads")
    print(f"free:        {mf * 1000:.2f} ms/token (96 tokens)")
    print(f"constrained: {mc * 1000:.2f} ms/token ({min(lengths)}-{max(lengths)} tokens, every answer valid)")
    print(f"constrained ÷ free: {mc / mf:.3f}")
    bars.check("constrained ÷ free time per token", mc / mf, "<=", 1.10, unit="×")
    return bars


def cleanup():
    for p in procs:
        p.terminate()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()


run(main, cleanup)
