"""The bundled engine's OpenAI features through the gateway, with the official `openai` SDK
(run by tests/tests/openai_routes.rs): n choices, unseeded vs seeded sampling, unique ids,
a streamed chat's first event. Prints one JSON object.

Usage: openai_sdk_engine.py BASE_URL MODEL
"""
import json
import sys
import time

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
out = {}
ask = dict(model=model, prompt="pick some words", max_tokens=12, extra_body={"ignore_eos": True})
two = client.completions.create(n=2, **ask)
out["n2"] = [c.text for c in sorted(two.choices, key=lambda c: c.index)]
out["unseeded"] = [client.completions.create(**ask).choices[0].text for _ in range(2)]
out["seeded"] = [client.completions.create(seed=5, **ask).choices[0].text for _ in range(2)]
out["ids"] = [client.completions.create(**ask).id for _ in range(8)]
start = time.monotonic()
stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": " w123" * 8000}],
                                        max_tokens=2, stream=True)
first = next(iter(stream))
out["first_event_s"] = time.monotonic() - start
out["first_role"] = first.choices[0].delta.role
for _ in stream:
    pass
print(json.dumps(out))
