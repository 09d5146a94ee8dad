"""A fake Kubernetes API server for rendering the chart with Helm's real engine.

helm-sdkpy has no `template` and no dry run, so the chart test installs the chart into this
server: it answers API discovery for the groups the chart uses, stores Helm's release
records (Secrets), answers 404 to "does it exist?" lookups and records every object the
install creates. The recorded objects are exactly what Helm would have applied to a cluster.
"""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

GROUPS = {
    # group/version: [(plural, kind, namespaced)]
    "v1": [("configmaps", "ConfigMap", True), ("services", "Service", True), ("serviceaccounts", "ServiceAccount", True),
           ("secrets", "Secret", True), ("persistentvolumeclaims", "PersistentVolumeClaim", True),
           ("pods", "Pod", True), ("namespaces", "Namespace", False)],
    "apps/v1": [("deployments", "Deployment", True), ("statefulsets", "StatefulSet", True)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    "autoscaling/v2": [("horizontalpodautoscalers", "HorizontalPodAutoscaler", True)],
    "rbac.authorization.k8s.io/v1": [("roles", "Role", True), ("rolebindings", "RoleBinding", True)],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True), ("ingresses", "Ingress", True)],
    "gateway.networking.k8s.io/v1": [("httproutes", "HTTPRoute", True)],
    "inference.networking.k8s.io/v1": [("inferencepools", "InferencePool", True)],
    "discovery.k8s.io/v1": [("endpointslices", "EndpointSlice", True)],
    "keda.sh/v1alpha1": [("scaledobjects", "ScaledObject", True)],
    "monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor", True)],
}


def resource_list(gv):
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": [
        {"name": p, "singularName": k.lower(), "namespaced": ns, "kind": k,
         "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]} for p, k, ns in GROUPS[gv]]}


class Server:
    def __init__(self):
        self.created = []      # objects the install created (Helm's release Secrets excluded)
        self.secrets = {}      # name -> Secret (Helm's release storage)
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def body(self):
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"{}")

            def not_found(self):
                self.send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                                "message": "not found"})

            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/version":
                    return self.send(200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0", "platform": "linux/amd64"})
                if path == "/api":
                    return self.send(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
                if path == "/apis":
                    groups = {}
                    for gv in GROUPS:
                        if "/" in gv:
                            g, v = gv.split("/")
                            groups.setdefault(g, []).append({"groupVersion": gv, "version": v})
                    return self.send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                        {"name": g, "versions": vs, "preferredVersion": vs[0]} for g, vs in groups.items()]})
                if path == "/api/v1":
                    return self.send(200, resource_list("v1"))
                if path.startswith("/apis/") and path.count("/") == 3:
                    gv = path[len("/apis/"):]
                    return self.send(200, resource_list(gv)) if gv in GROUPS else self.not_found()
                if "/secrets" in path:
                    name = path.rsplit("/", 1)[-1]
                    if name == "secrets":
                        with server.lock:
                            items = list(server.secrets.values())
                        return self.send(200, {"kind": "SecretList", "apiVersion": "v1", "metadata": {}, "items": items})
                    with server.lock:
                        s = server.secrets.get(name)
                    return self.send(200, s) if s else self.not_found()
                return self.not_found()

            def do_POST(self):
                if self.protobuf():
                    return self.send(201, self.release_record())
                obj = self.body()
                obj.setdefault("metadata", {}).setdefault("resourceVersion", "1")
                if obj.get("kind") == "Secret" and obj["metadata"].get("labels", {}).get("owner") == "helm":
                    with server.lock:
                        server.secrets[obj["metadata"]["name"]] = obj
                else:
                    with server.lock:
                        server.created.append(obj)
                self.send(201, obj)

            def protobuf(self):
                # Helm writes its release records (Secrets) as protobuf; they are not the
                # chart's objects, so they are acknowledged and not kept.
                if "protobuf" in (self.headers.get("Content-Type") or ""):
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    return True
                return False

            def release_record(self):
                return {"kind": "Secret", "apiVersion": "v1",
                        "metadata": {"name": "sh.helm.release", "resourceVersion": "1"}}

            def do_PUT(self):
                if self.protobuf():
                    return self.send(200, self.release_record())
                obj = self.body()
                if obj.get("kind") == "Secret":
                    with server.lock:
                        server.secrets[obj["metadata"]["name"]] = obj
                self.send(200, obj)

            do_PATCH = do_PUT

            def do_DELETE(self):
                self.send(200, {"kind": "Status", "status": "Success"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def kubeconfig(self, path, namespace):
        with open(path, "w") as f:
            json.dump({"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                       "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
                       "users": [{"name": "fake", "user": {"token": "fake"}}],
                       "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}]},
                      f)

    def close(self):
        self.httpd.shutdown()
