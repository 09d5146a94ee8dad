#!/usr/bin/env bash
# Instructions the gateway spends per request, counted by callgrind (repeatable where
# timings on a shared machine are not): an `instant` sim engine, the release gateway under
# `valgrind --tool=callgrind`, and N streamed 16-in/16-out completions at concurrency 8 on
# 8 keep-alive connections opened first. The counters are zeroed once the gateway is ready,
# so the count is the serving alone (start-up, ~65M mostly parsing the system CA bundle, is
# left out; the background scraper's share over the run is in). Prints the count per request
# and the profile file for `callgrind_annotate` (`--inclusive=yes` for the phases).
#
# Bars: none (the count is reported, README Performance). Exit status: 0 once it has counted,
# 2 when it could not (a setup error: a build, a server or the load run failed). Like the other
# benchmarks here, a missed bar would be 1.
#
# Usage: loadtest/bench/profile_gateway.sh [REQUESTS]   (default 3000; takes ~1 minute)
# Environment: SWITCHYARD_BENCH_POLICY (routing policy, default least_load; `cost` is the
# gateway's default), SWITCHYARD_BENCH_GATEWAY_BIN (a gateway binary to count instead of the
# one built here, e.g. an older build for a before/after comparison), SWITCHYARD_BENCH_KV_EVENTS=1
# (precise routing on: the engine tokenizes with the SmolLM2 GGUF that scripts/setup.sh fetches
# and publishes KV events, the gateway subscribes and tokenizes every request, `kv_events`).
set -euo pipefail
trap 'echo "setup error: line $LINENO failed" >&2; exit 2' ERR
cd "$(dirname "$0")/../.."
N="${1:-3000}"
[[ $N =~ ^[1-9][0-9]*$ ]] || { echo "setup error: REQUESTS must be a positive number, got $N" >&2; exit 2; }
command -v valgrind >/dev/null || apt-get install -y -qq valgrind
cargo build --release --locked -p switchyard-engine -p switchyard-gateway -p switchyard-loadtest
B=target/release
GW_BIN="${SWITCHYARD_BENCH_GATEWAY_BIN:-$B/switchyard-gateway}"
POLICY="${SWITCHYARD_BENCH_POLICY:-least_load}"
W=.cache/bench/profile-gateway
rm -rf "$W" && mkdir -p "$W"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ENGINE_PORT=$(free_port) GW_PORT=$(free_port) ADMIN_PORT=$(free_port)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
engine_args=() backend_extra="" kv_section=""
if [[ ${SWITCHYARD_BENCH_KV_EVENTS:-0} == 1 ]]; then
  MODEL="${SWITCHYARD_MODEL_DIR:-.cache/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
  [[ -f $MODEL ]] || { echo "setup error: $MODEL is missing (scripts/setup.sh fetches it)" >&2; exit 2; }
  KV_PORT=$(free_port)
  engine_args=(--tokenizer "$MODEL" --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$KV_PORT\"}")
  backend_extra="
      kv_events: tcp://127.0.0.1:$KV_PORT"
  kv_section="kv_events: { tokenizer: $MODEL }"
fi
RUST_LOG=warn $B/switchyard-engine --host 127.0.0.1 --port "$ENGINE_PORT" --backend sim --sim-profile instant \
  "${engine_args[@]}" >"$W/engine.log" 2>&1 &
pids+=($!)
cat >"$W/gateway.yaml" <<YAML
listen: 127.0.0.1:$GW_PORT
admin_listen: 127.0.0.1:$ADMIN_PORT
threads: 2
discovery:
  static:
    - url: http://127.0.0.1:$ENGINE_PORT$backend_extra
policy: { type: $POLICY }
$kv_section
YAML
RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$W/callgrind.out" \
  "$GW_BIN" --config "$W/gateway.yaml" >"$W/gateway.log" 2>&1 &
GW=$!
pids+=($GW)
for _ in $(seq 1 300); do
  curl -fs -o /dev/null "http://127.0.0.1:$GW_PORT/-/ready" && break
  sleep 0.2
done
curl -fs -o /dev/null "http://127.0.0.1:$GW_PORT/-/ready" || { echo "setup error: the gateway did not become ready; see $W/gateway.log" >&2; exit 2; }
callgrind_control -z "$GW" >/dev/null
$B/switchyard-loadtest run --endpoint completions --target "gateway=http://127.0.0.1:$GW_PORT" \
  --input-len 16 --output-len 16 --concurrency 8 --requests "$N" --prewarm-connections 8 \
  --out "$W/loadtest" 2>&1 | tee "$W/loadtest.log" | grep "req/s"
kill -INT "$GW"
wait "$GW" 2>/dev/null || true
total=$(callgrind_annotate "$W/callgrind.out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}' || true)
[[ $total =~ ^[0-9]+$ ]] || { echo "setup error: no instruction count in $W/callgrind.out" >&2; exit 2; }
echo "gateway instructions ($POLICY${kv_section:+, kv_events}, $GW_BIN): $total for $N requests after start-up, $((total / N)) per request; profile: $W/callgrind.out"
echo "bars: none (this benchmark reports figures only)"
