// Custom resources the chart renders — KEDA's ScaledObject, prometheus-operator's
// ServiceMonitor, the Gateway API's HTTPRoute — checked against their CRDs' OpenAPI schemas, as compiled into validators
// by the kubernetes-models packages (npm: @kubernetes-models/keda, .../prometheus-operator,
// .../gateway-api, installed by scripts/test-chart.sh). kubernetes-validate, which checks the built-in kinds,
// knows no CRD.
//
// Usage: node validate_crds.mjs NODE_MODULES_DIR < objects.json   (a JSON array)
// Prints one line per invalid object and exits 1 if there is any; 2 on a setup error.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.argv[2];
const MODELS = {
  "keda.sh/v1alpha1/ScaledObject": ["@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject.js", "ScaledObject"],
  "gateway.networking.k8s.io/v1/HTTPRoute": [
    "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute.js",
    "HTTPRoute",
  ],
  "monitoring.coreos.com/v1/ServiceMonitor": [
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor.js",
    "ServiceMonitor",
  ],
};

let bad = 0;
for (const obj of JSON.parse(readFileSync(0, "utf8"))) {
  const key = `${obj.apiVersion}/${obj.kind}`;
  const model = MODELS[key];
  if (!model) {
    console.log(`${key}: no CRD schema known for this kind`);
    process.exit(2);
  }
  const Kind = (await import(pathToFileURL(join(modules, model[0])).href))[model[1]];
  try {
    new Kind(obj).validate();
  } catch (e) {
    bad++;
    console.log(`${key} ${obj.metadata?.name}: ${e.message}`);
  }
}
process.exit(bad ? 1 : 0);
