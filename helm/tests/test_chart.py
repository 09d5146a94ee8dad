#!/usr/bin/env python3
"""The Helm chart, rendered by Helm itself and checked without a cluster.

1. `helm lint` through the Helm library in `helm-sdkpy`.
2. For the defaults, every values example in `helm/examples/` (bundled CPU engine, vLLM on
   GPUs with TP 4, KEDA autoscaling from zero, the TLS + API-key edge) and every option on,
   the chart is installed with Helm's real engine into a fake Kubernetes API server
   (`fake_kube.py`), which records every object.
3. Every recorded object of a built-in kind is validated against the Kubernetes 1.31 JSON
   schemas (`kubernetes-validate`, strict: unknown fields are errors); KEDA's ScaledObject and
   the ServiceMonitor are checked field by field.
4. The gateway config the chart renders is accepted by `switchyard-gateway --validate`, and
   the facts the chart promises hold (probes, drain timing, GPUs, RBAC, checksums, TLS and
   API-key Secrets mounted where the config reads them). `--validate` reads the TLS
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

with open(os.path.join(CHART, "values.yaml")) as fh:
    DEFAULTS = yaml.safe_load(fh)
TLS_DIR, KEYS_DIR = "/etc/switchyard/tls", "/etc/switchyard/keys"

failures = []


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
# Kinds kubernetes-validate does not know, checked against their CRDs by validate_crds.mjs.
CUSTOM_KINDS = ("ScaledObject", "ServiceMonitor", "HTTPRoute")


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


def check_scenario(name, values, release, objs, gateway_bin):
    tag = f"[{name}]"
    custom = [o for o in objs if o.get("kind") in CUSTOM_KINDS]
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
        k8s = cfg["discovery"].get("kubernetes", {})
        check(k8s == {"namespace": NS, "service": "sy-switchyard-engine", "port_name": "shim"},
              f"{tag} engines are discovered through the engine Service's EndpointSlices: {cfg['discovery']}")
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
        else:
            check(any(a.startswith("--backend=cpu") for a in engine["args"]), f"{tag} the bundled engine runs the cpu backend")
            check(spec.get("initContainers"), f"{tag} the model is fetched into the cache")

    role = by_kind(objs, "Role")
    check(role and any("endpointslices" in r["resources"] and set(r["verbs"]) == {"get", "list", "watch"}
                       for r in role[0]["rules"]), f"{tag} the Role reads EndpointSlices")
    pdbs = by_kind(objs, "PodDisruptionBudget")
    check(pdbs and all(p["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow" for p in pdbs),
          f"{tag} a PodDisruptionBudget that lets unhealthy pods be evicted (node drains never block)")
    notes = release.get("info", {}).get("notes") or ""
    model = values.get("engine", {}).get("model", "SmolLM2-135M-Instruct")
    check("://127.0.0.1:8080/v1/chat/completions" in notes and f'"model": "{model}"' in notes,
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
    ing, routes = by_kind(objs, "Ingress"), by_kind(objs, "HTTPRoute")
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
    """TLS, API keys and drain: values -> config, mounts, probes, Service, grace period."""
    gwv = v["gateway"]
    dep = gateway_deployment(objs)
    pod = dep["spec"]["template"]["spec"]
    gw = container(pod, "gateway")
    notes = release.get("info", {}).get("notes") or ""
    svc = next(o for o in by_kind(objs, "Service") if o["metadata"]["name"] == "sy-switchyard-gateway")
    http_port = next(p for p in svc["spec"]["ports"] if p["name"] == "http")
    ready, live = gw["readinessProbe"]["httpGet"], gw["livenessProbe"]["httpGet"]

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
    check(live == {"path": "/-/healthz", "port": "admin", "scheme": "HTTP"}, f"{tag} liveness is HTTP on admin: {live}")
    vol, mnt = secret_mount(pod, gw, "tls")
    if gwv["tls"]["enabled"]:
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
                        "bearerTokenSecret")]:
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
    # No image registry: a clear refusal, not an ImagePullBackOff.
    try:
        await install({}, registry=False)
        failures.append("the chart rendered without image.registry")
    except Exception as e:
        check("image.registry" in str(e) and "build-images" in str(e), f"no registry: the error says what to do: {e}")
    # A 53-character release name (Helm's limit) gives valid names everywhere.
    long_name = "a-release-name-of-fifty-three-characters-for-testing"[:53].ljust(53, "x")
    try:
        _, objs = await install(merged(SCENARIOS["everything-on"], {"keda": {"enabled": True}}), name=long_name)
        for o in objs:
            n = o["metadata"]["name"]
            check(len(n) <= 63, f"[long name] {o['kind']}/{n} is {len(n)} characters")
            if o["kind"] == "StatefulSet":
                check(len(n) <= 52, f"[long name] StatefulSet {n} leaves no room for its pods' revision label")
            if o["kind"] not in CUSTOM_KINDS:
                try:
                    kubernetes_validate.validate(o, K8S_VERSION, strict=True)
                except Exception as e:
                    failures.append(f"[long name] {o['kind']}/{n}: {e}")
    except Exception as e:
        failures.append(f"[long name] helm install failed: {e}")
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
