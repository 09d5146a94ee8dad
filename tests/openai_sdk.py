"""Every OpenAI route through the gateway with the official `openai` Python SDK, as a user
would call it (run by tests/tests/openai_routes.rs with the SDK that scripts/setup.sh
installs in .cache/openai-venv). Prints one JSON object: per call, what the SDK returned
(or the error it raised).

Usage: openai_sdk.py BASE_URL API_KEY   (BASE_URL: the gateway, e.g. http://127.0.0.1:8080)
"""
import json
import sys

import openai

base, key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=20)
results = {}


def call(name, fn):
    try:
        results[name] = {"ok": fn()}
    except openai.APIStatusError as e:
        results[name] = {"error": f"{type(e).__name__}: {e}", "status": e.status_code, "code": e.code}
    except Exception as e:  # noqa: BLE001 - the test reads the error
        results[name] = {"error": f"{type(e).__name__}: {e}"}


def chat_stream():
    chunks = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                            stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks)


def completion_stream():
    return "".join(c.choices[0].text for c in client.completions.create(model="llama", prompt="hi", stream=True))


def responses_stream():
    events = client.responses.create(model="llama", input="hi", stream=True)
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def transcription(stream):
    audio = ("clip.wav", b"RIFF\x00\x00\x00\x00WAVEfmt \r\n--not-a-boundary\r\n", "audio/wav")
    if not stream:
        return client.audio.transcriptions.create(model="whisper", file=audio).text
    events = client.audio.transcriptions.create(model="whisper", file=audio, stream=True)
    return "".join(getattr(e, "delta", "") for e in events if e.type == "transcript.text.delta")


call("chat", lambda: client.chat.completions.create(
    model="llama", messages=[{"role": "user", "content": "hi"}]).choices[0].message.content)
call("chat_stream", chat_stream)
call("completion", lambda: client.completions.create(model="llama", prompt="hi").choices[0].text)
call("completion_stream", completion_stream)
call("embeddings", lambda: client.embeddings.create(model="embedder", input="hi").data[0].embedding)
call("responses", lambda: client.responses.create(model="llama", input="hi").output_text)
call("responses_stream", responses_stream)
call("transcription", lambda: transcription(False))
call("transcription_stream", lambda: transcription(True))
# vLLM's routes the SDK has no method for: its generic `post`, as users call them.
call("rerank", lambda: client.post("/rerank", cast_to=object, body={
    "model": "reranker", "query": "q", "documents": ["a", "b"]})["results"][0]["relevance_score"])
call("rerank_root", lambda: client.post(f"{base}/rerank", cast_to=object, body={
    "model": "reranker", "query": "q", "documents": ["a", "b"]})["results"][0]["index"])
call("tokenize", lambda: client.post(f"{base}/tokenize", cast_to=object, body={
    "model": "llama", "prompt": "hi"})["tokens"])
call("models", lambda: sorted(m.id for m in client.models.list()))
call("model", lambda: client.models.retrieve("llama").owned_by)
call("unknown_model", lambda: client.chat.completions.create(
    model="nope", messages=[{"role": "user", "content": "hi"}]).choices[0].message.content)
print(json.dumps(results))
