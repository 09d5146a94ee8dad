"""The bundled engine's structured output, tool calls and embeddings through the gateway,
with the official `openai` SDK and `jsonschema` (run by tests/tests/openai_routes.rs against
the cpu backend serving SmolLM2). Prints one JSON object.

Usage: openai_sdk_structured.py BASE_URL MODEL
"""
import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
out = {}

person = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome", "Tokyo"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
cities = ["Paris", "London", "Rome", "Tokyo"]


def describe(i):
    r = client.chat.completions.create(
        model=model, max_tokens=200, response_format=fmt,
        messages=[{"role": "user", "content": f"Invent person number {i} who lives in {cities[i % 4]}. Answer in JSON."}])
    doc = json.loads(r.choices[0].message.content)
    jsonschema.validate(doc, person)
    return 1


with ThreadPoolExecutor(max_workers=20) as pool:
    out["schema_valid"] = sum(pool.map(describe, range(20)))

stream = client.chat.completions.create(model=model, max_tokens=200, response_format=fmt, stream=True,
                                        messages=[{"role": "user", "content": "A person in Rome, as JSON."}])
text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
jsonschema.validate(json.loads(text), person)
out["schema_streamed_valid"] = True

r = client.chat.completions.create(model=model, max_tokens=300, temperature=0, response_format={"type": "json_object"},
                                   messages=[{"role": "user", "content": "Give me a JSON object about cats."}])
out["json_object"] = isinstance(json.loads(r.choices[0].message.content), dict)

weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": weather}},
         {"type": "function", "function": {"name": "get_time",
                                           "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]
ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
r = client.chat.completions.create(model=model, max_tokens=100, messages=ask, tools=tools,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
call = r.choices[0].message.tool_calls[0]
jsonschema.validate(json.loads(call.function.arguments), weather)
out["tool_call"] = {"name": call.function.name, "valid": True, "id": call.id}
r = client.chat.completions.create(model=model, max_tokens=150, messages=ask, tools=tools, tool_choice="required")
call = r.choices[0].message.tool_calls[0]
params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
out["required_call_valid"] = r.choices[0].finish_reason == "tool_calls"

e = [d.embedding for d in client.embeddings.create(model=model, input=["cat", "kitten", "carburetor"]).data]


def cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


out["cos_cat_kitten"], out["cos_cat_carburetor"] = cos(e[0], e[1]), cos(e[0], e[2])
out["n2"] = len(client.chat.completions.create(model=model, max_tokens=4, n=2, messages=ask).choices)

r = client.responses.create(model=model, input="Name a city in France.", instructions="Answer in one word.",
                           max_output_tokens=16, temperature=0)
out["responses_text"] = r.output_text
out["responses_status"] = r.status
r = client.responses.create(model=model, input="A person in Tokyo, as JSON.", max_output_tokens=200,
                           text={"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}})
jsonschema.validate(json.loads(r.output_text), person)
out["responses_schema_valid"] = True
deltas, final = "", None
for ev in client.responses.create(model=model, input="Say hello.", max_output_tokens=16, stream=True,
                                 temperature=0):
    if ev.type == "response.output_text.delta":
        deltas += ev.delta
    elif ev.type in ("response.completed", "response.incomplete"):
        final = ev.response.output_text
out["responses_streamed_matches"] = bool(deltas) and deltas == final

bad = {}


def refused(name, call):
    try:
        call()
        bad[name] = "accepted"
    except openai.BadRequestError as err:
        bad[name] = {"status": err.status_code, "param": (err.body or {}).get("param")}


refused("malformed_schema", lambda: client.chat.completions.create(
    model=model, messages=ask,
    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}}))
refused("unknown_tool", lambda: client.chat.completions.create(
    model=model, messages=ask, tools=tools, tool_choice={"type": "function", "function": {"name": "fly"}}))
refused("n_over", lambda: client.chat.completions.create(model=model, messages=ask, n=17))
refused("dimensions", lambda: client.embeddings.create(model=model, input="cat", dimensions=8))
refused("logit_bias", lambda: client.chat.completions.create(model=model, messages=ask, logit_bias={"1": 5}))
refused("auto_tools", lambda: client.chat.completions.create(model=model, messages=ask, tools=tools))
out["bad"] = bad
print(json.dumps(out))
