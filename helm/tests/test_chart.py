#!/usr/bin/env python3
"""The Helm chart, rendered by Helm itself and checked without a cluster.

1. `helm lint` through the Helm library in `helm-sdkpy`.
2. For the defaults, each values example of the README (`helm/examples/`: bundled CPU
   engine, vLLM on GPUs with TP 4, KEDA autoscaling from zero) and every option on, the chart is installed with Helm's real
   engine into a fake Kubernetes API server (`fake_kube.py`), which records every object.
3. Every recorded object of a built-in kind is validated against the Kubernetes 1.31 JSON
   schemas (`kubernetes-validate`, strict: unknown fields are errors); KEDA's ScaledObject and
   the ServiceMonitor are checked field by field.
4. The gateway config the chart renders is accepted by `switchyard-gateway --validate`, and
   the facts the chart promises hold (probes, drain timing, GPUs, RBAC, checksums).

Usage: test_chart.py GATEWAY_BINARY (scripts/test-chart.sh sets up Python 3.12 and runs it).
Exits non-zero with every failure listed.
"""
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import helm_sdkpy
import kubernetes_validate
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_kube import Server  # noqa: E402

CHART = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "switchyard")
K8S_VERSION = "1.31"
NS = "serving"

EXAMPLES = os.path.join(os.path.dirname(CHART), "examples")
# The README's values examples, plus every option on at once.
SCENARIOS = {"defaults": {}}
for f in sorted(os.listdir(EXAMPLES)):
    with open(os.path.join(EXAMPLES, f)) as fh:
        SCENARIOS[f.removesuffix(".yaml")] = yaml.safe_load(fh)
SCENARIOS["everything-on"] = {
    "gateway": {"hpa": {"enabled": True}, "tls": {"secretName": "edge-tls"},
                "service": {"type": "NodePort", "nodePort": 30080}},
    "serviceMonitor": {"enabled": True}, "networkPolicy": {"enabled": True},
    "engine": {"replicas": 3, "shim": {"drainTimeoutSeconds": 60}},
}

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
    return cond


async def install(values):
    server = Server()
    try:
        kubeconfig = os.path.join(tempfile.mkdtemp(), "kubeconfig")
        server.kubeconfig(kubeconfig, NS)
        cfg = helm_sdkpy.Configuration(namespace=NS, kubeconfig=kubeconfig)
        release = await helm_sdkpy.Install(cfg).run("sy", CHART, values=values, wait=False, timeout=60)
        return release, list(server.created)
    finally:
        server.close()


def by_kind(objs, kind):
    return [o for o in objs if o.get("kind") == kind]


def container(pod_spec, name):
    return next((c for c in pod_spec["containers"] if c["name"] == name), None)


def check_scenario(name, values, release, objs, gateway_bin):
    tag = f"[{name}]"
    for o in objs:
        kind, meta = o.get("kind"), o.get("metadata", {})
        if kind in ("ScaledObject", "ServiceMonitor"):
            continue
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except Exception as e:  # ValidationError, SchemaNotFoundError, …
            failures.append(f"{tag} {kind}/{meta.get('name')}: {e}")

    # The gateway config: valid for the gateway itself, and rolled out on change.
    cm = by_kind(objs, "ConfigMap")
    if check(len(cm) == 1, f"{tag} one gateway ConfigMap"):
        text = cm[0]["data"]["gateway.yaml"]
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write(text)
        r = subprocess.run([gateway_bin, "--config", f.name, "--validate"], capture_output=True, text=True)
        check(r.returncode == 0, f"{tag} switchyard-gateway --validate rejects the rendered config: {r.stdout}{r.stderr}")
        cfg = yaml.safe_load(text)
        k8s = cfg["discovery"].get("kubernetes", {})
        check(k8s == {"namespace": NS, "service": "sy-switchyard-engine", "port_name": "shim"},
              f"{tag} engines are discovered through the engine Service's EndpointSlices: {cfg['discovery']}")
        svc = next(o for o in by_kind(objs, "Service") if o["metadata"]["name"] == "sy-switchyard-engine")
        check(not svc["spec"].get("publishNotReadyAddresses") and any(p["name"] == "shim" for p in svc["spec"]["ports"]),
              f"{tag} the engine Service publishes ready pods only, on the port named shim")
        check(cfg["scrape"]["source"] == "load", f"{tag} the gateway reads the sidecars' /load")
        check(cfg.get("admission", {}).get("max_wait_ms", 0) > 0,
              f"{tag} the admission queue holds requests while engines scale up (KEDA's from-zero signal)")
        dep = by_kind(objs, "Deployment")[0]
        checksum = dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        check(checksum == hashlib.sha256(text.rstrip("\n").encode()).hexdigest()
              or checksum == hashlib.sha256(text.encode()).hexdigest(),
              f"{tag} the Deployment's checksum/config is the config's sha256")
        gw = container(dep["spec"]["template"]["spec"], "gateway")
        check(gw["readinessProbe"]["httpGet"]["path"] == "/-/ready", f"{tag} gateway readiness is /-/ready")

    # Engines: sidecar, readiness, drain timing, shm, cache, GPUs.
    sts = by_kind(objs, "StatefulSet")
    if check(len(sts) == 1, f"{tag} one engine StatefulSet"):
        spec = sts[0]["spec"]["template"]["spec"]
        shim, engine = container(spec, "shim"), container(spec, "engine")
        check(shim and shim["readinessProbe"]["httpGet"]["path"] == "/-/healthz", f"{tag} readiness is the shim's /-/healthz")
        drain = next(int(a.split("=")[1]) for a in shim["args"] if a.startswith("--drain-timeout="))
        check(spec["terminationGracePeriodSeconds"] > drain + 5,
              f"{tag} terminationGracePeriodSeconds ({spec['terminationGracePeriodSeconds']}) outlasts preStop + drain ({drain})")
        check("preStop" in shim.get("lifecycle", {}), f"{tag} the shim has a preStop")
        dshm = next((v for v in spec["volumes"] if v["name"] == "dshm"), None)
        check(dshm and dshm["emptyDir"].get("medium") == "Memory", f"{tag} /dev/shm is a memory emptyDir")
        check(sts[0]["spec"].get("volumeClaimTemplates"), f"{tag} the model cache is a PVC")
        keda = values.get("keda", {}).get("enabled", False)
        check(("replicas" in sts[0]["spec"]) != keda, f"{tag} replicas are KEDA's when KEDA is on, the chart's otherwise")
        if values.get("engine", {}).get("kind") == "vllm":
            tp = values["engine"]["vllm"]["tensorParallelSize"]
            check(f"--tensor-parallel-size={tp}" in engine["args"] and "--enable-chunked-prefill" in engine["args"],
                  f"{tag} vLLM runs with TP {tp} and chunked prefill: {engine['args']}")
            check(engine["resources"]["limits"].get("nvidia.com/gpu") == values["engine"]["gpus"], f"{tag} GPUs per pod")
            check("--dialect=vllm" in shim["args"], f"{tag} the shim reads vLLM's dialect")
        else:
            check(any(a.startswith("--backend=cpu") for a in engine["args"]), f"{tag} the bundled engine runs the cpu backend")
            check(spec.get("initContainers"), f"{tag} the model is fetched into the cache")

    role = by_kind(objs, "Role")
    check(role and any("endpointslices" in r["resources"] and set(r["verbs"]) == {"get", "list", "watch"}
                       for r in role[0]["rules"]), f"{tag} the Role reads EndpointSlices")
    check(by_kind(objs, "PodDisruptionBudget"), f"{tag} a PodDisruptionBudget")
    notes = release.get("info", {}).get("notes") or ""
    model = values.get("engine", {}).get("model", "SmolLM2-135M-Instruct")
    check("curl -s http://127.0.0.1:8080/v1/chat/completions" in notes and f'"model": "{model}"' in notes,
          f"{tag} NOTES.txt has a working curl for the served model: {notes!r}")

    so = by_kind(objs, "ScaledObject")
    if values.get("keda", {}).get("enabled"):
        if check(len(so) == 1, f"{tag} a KEDA ScaledObject"):
            s = so[0]
            check(s["apiVersion"] == "keda.sh/v1alpha1" and s["spec"]["scaleTargetRef"]["kind"] == "StatefulSet",
                  f"{tag} ScaledObject targets the engine StatefulSet")
            check(s["spec"]["minReplicaCount"] == 0, f"{tag} scale from zero")
            queries = " ".join(t["metadata"]["query"] for t in s["spec"]["triggers"])
            for q in ["sum(vllm:num_requests_waiting", "avg(vllm:kv_cache_usage_perc", "sum(switchyard_queue_depth"]:
                check(q in queries and all(t["type"] == "prometheus" for t in s["spec"]["triggers"]),
                      f"{tag} a Prometheus trigger on {q}")
    else:
        check(not so, f"{tag} no ScaledObject unless keda.enabled")
    sm = by_kind(objs, "ServiceMonitor")
    if values.get("serviceMonitor", {}).get("enabled"):
        check(len(sm) == 1 and {e["port"] for e in sm[0]["spec"]["endpoints"]} == {"admin", "shim"},
              f"{tag} the ServiceMonitor scrapes the gateway's admin port and the sidecars")
    if values.get("gateway", {}).get("hpa", {}).get("enabled"):
        check(by_kind(objs, "HorizontalPodAutoscaler"), f"{tag} a gateway HPA")
        check("replicas" not in by_kind(objs, "Deployment")[0]["spec"], f"{tag} the HPA owns the gateway's replicas")
    if values.get("gateway", {}).get("tls", {}).get("secretName"):
        vols = by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]["volumes"]
        check(any(v.get("secret", {}).get("secretName") == "edge-tls" for v in vols), f"{tag} the TLS secret is mounted")


async def main():
    if len(sys.argv) != 2 or not os.access(sys.argv[1], os.X_OK):
        sys.exit("usage: test_chart.py PATH/TO/switchyard-gateway")
    lint = await helm_sdkpy.Lint(helm_sdkpy.Configuration()).run(CHART)
    check(lint.get("Errors") is None, f"helm lint: {json.dumps(lint, default=str)}")
    # values.schema.json turns bad values away before anything renders.
    for bad, field in [({"engine": {"kind": "tgi"}}, "kind"), ({"gateway": {"service": {"type": "Ingress"}}}, "type"),
                       ({"engine": {"shim": {"dialect": "x"}}}, "dialect")]:
        try:
            await install(bad)
            failures.append(f"values {bad} were accepted")
        except Exception as e:
            check(field in str(e), f"values {bad}: the schema error should name `{field}`: {e}")
    for name, values in SCENARIOS.items():
        try:
            release, objs = await install(values)
        except Exception as e:
            failures.append(f"[{name}] helm install failed: {e}")
            continue
        print(f"[{name}] rendered {len(objs)} objects: {', '.join(sorted({o['kind'] for o in objs}))}")
        check_scenario(name, values, release, objs, sys.argv[1])
    if failures:
        print("\nchart test FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("chart test passed: lint clean; every scenario rendered, schema-valid and accepted by the gateway")


if __name__ == "__main__":
    asyncio.run(main())
