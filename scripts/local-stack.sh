#!/usr/bin/env bash
# The main job: a local Switchyard stack on localhost: two engines on :8101 and :8102 behind
# the gateway on :8080 (admin :9090), configured by config/gateway.example.yaml.
# By default the engines run the real SmolLM2-135M-Instruct on the CPU (one thread each);
# BACKEND=sim runs simulated H100s instead (SIM_PROFILE, default h100-llama3-8b).
# Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --locked -p switchyard-engine -p switchyard-gateway

BACKEND=${BACKEND:-cpu}
PROFILE=${SIM_PROFILE:-h100-llama3-8b}
case "$BACKEND" in
  cpu) engine_args=(--backend cpu --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
                    --served-model-name SmolLM2-135M-Instruct --threads 1 --kv-cache-space 0.5)
       what="SmolLM2-135M-Instruct engines (cpu)"
       hint="greedy decoding and a question with a short answer: what a 135M model does well; it answers \"Paris\"" ;;
  sim) engine_args=(--backend sim --sim-profile "$PROFILE"); what="sim engines ($PROFILE)"
       hint="sim engines answer with placeholder tokens, at the pace of the simulated GPU" ;;
  *) echo "BACKEND must be cpu or sim, got $BACKEND" >&2; exit 2 ;;
esac
PORTS=(8101 8102)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

mkdir -p .cache/logs
for port in "${PORTS[@]}"; do
  ./target/release/switchyard-engine --host 127.0.0.1 --port "$port" "${engine_args[@]}" \
    >".cache/logs/engine-$port.log" 2>&1 &
  pids+=($!)
done
for port in "${PORTS[@]}"; do
  for _ in $(seq 1 100); do
    curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 0.1
  done
  curl -fsS "http://127.0.0.1:$port/health" >/dev/null || { echo "engine on :$port did not start; see .cache/logs/engine-$port.log" >&2; exit 1; }
done

./target/release/switchyard-gateway --config config/gateway.example.yaml >.cache/logs/gateway.log 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do
  curl -fsS http://127.0.0.1:8080/-/ready >/dev/null 2>&1 && break
  sleep 0.1
done
curl -fsS http://127.0.0.1:8080/-/ready >/dev/null || { echo "gateway did not become ready; see .cache/logs/gateway.log" >&2; exit 1; }

model=$(curl -fsS http://127.0.0.1:8080/v1/models | sed -E 's/.*"id":"([^"]+)".*/\1/')
cat <<MSG

Switchyard local stack is up: gateway on :8080 → ${#PORTS[@]} $what on ${PORTS[*]}.
Logs: .cache/logs/. Gateway metrics: curl http://127.0.0.1:9090/metrics
Backends as the gateway sees them: curl http://127.0.0.1:9090/admin/backends

Try ($hint):
  curl -N http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$model", "temperature": 0, "max_tokens": 16, "stream": true,
         "messages": [{"role": "user", "content": "Which city is the capital of France? Answer with one word."}]}'

Ctrl-C to stop.
MSG
wait
