#!/usr/bin/env python3
"""A `switchyard-loadtest cluster --router` for loadtest/bench/epp.py: Envoy in front of the
cluster's engines, either with Switchyard as its Endpoint Picker (`--mode epp`: the gateway
with `listen: null` and `epp:`, Envoy from config/envoy-epp.yaml) or alone, round-robin over
the engines (`--mode round-robin`).

It runs until killed; its children die with it (PR_SET_PDEATHSIG), since the loadtest ends a
router with SIGKILL. Logs go under --dir.
Usage: epp_router.py --mode epp|round-robin --port PORT --dir DIR [--policy cost] WORKER_URL...
"""
import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENVOY = os.environ.get("SWITCHYARD_ENVOY", os.path.join(ROOT, ".cache", "envoy", "envoy", "_bin", "envoy"))
# SWITCHYARD_BENCH_GATEWAY_BIN: another gateway binary (an older build, for a before/after).
GATEWAY = os.environ.get("SWITCHYARD_BENCH_GATEWAY_BIN") or os.path.join(ROOT, "target", "release", "switchyard-gateway")
PR_SET_PDEATHSIG = 1


def die_with_parent():
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd, log):
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)


def envoy_epp_config(port, epp_port):
    """config/envoy-epp.yaml with its listener on `port` and the picker at `epp_port`."""
    with open(os.path.join(ROOT, "config", "envoy-epp.yaml")) as f:
        yaml = f.read()
    for old, new in [("port_value: 19000", f"port_value: {free_port()}"), ("port_value: 8081", f"port_value: {port}"),
                     ("port_value: 9002", f"port_value: {epp_port}")]:
        if old not in yaml:
            sys.exit(f"config/envoy-epp.yaml no longer has `{old}`")
        yaml = yaml.replace(old, new, 1)
    return yaml


def envoy_round_robin_config(port, workers):
    """Envoy alone: the same listener and router, a static round-robin cluster of `workers`."""
    endpoints = []
    for w in workers:
        host, p = w.removeprefix("http://").rsplit(":", 1)
        endpoints.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(p)}}}})
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gw",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "engines", "timeout": "86400s", "idle_timeout": "86400s"}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router", "suppress_envoy_headers": True}}],
    }
    return json.dumps({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}}},
        "static_resources": {
            "listeners": [{"name": "gw", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                            "typed_config": hcm}]}]}],
            "clusters": [{"name": "engines", "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "5s",
                          "load_assignment": {"cluster_name": "engines", "endpoints": [{"lb_endpoints": endpoints}]}}],
        },
    })


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["epp", "round-robin"], required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--policy", default="cost")
    ap.add_argument("workers", nargs="+")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    children = []
    if args.mode == "epp":
        epp_port = free_port()
        config = os.path.join(args.dir, "gateway-epp.yaml")
        with open(config, "w") as f:
            f.write(f"listen: null\nadmin_listen: 127.0.0.1:{free_port()}\nepp: {{ listen: 127.0.0.1:{epp_port} }}\n"
                    f"policy: {{ type: {args.policy} }}\ndiscovery:\n  static:\n")
            f.writelines(f"    - url: {w}\n" for w in args.workers)
        children.append(spawn([GATEWAY, "--config", config], open(os.path.join(args.dir, "gateway-epp.log"), "w")))
        envoy_config = os.path.join(args.dir, "envoy.yaml")
        with open(envoy_config, "w") as f:
            f.write(envoy_epp_config(args.port, epp_port))
    else:
        envoy_config = os.path.join(args.dir, "envoy-round-robin.json")
        with open(envoy_config, "w") as f:
            f.write(envoy_round_robin_config(args.port, args.workers))
    children.append(spawn([ENVOY, "-c", envoy_config, "--disable-hot-restart", "--concurrency", "2", "--log-level",
                           "warn"], open(os.path.join(args.dir, "envoy.log"), "w")))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while all(c.poll() is None for c in children):
            time.sleep(0.2)
        sys.exit(f"a child exited: see {args.dir}")
    finally:
        for c in children:
            c.kill()


if __name__ == "__main__":
    main()
