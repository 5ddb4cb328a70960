// Validate prometheus-operator custom resources (ServiceMonitor, PrometheusRule, ...) against
// the CRD schemas bundled in @kubernetes-models/prometheus-operator (installed by
// install-tools.sh). Input on stdin: a JSON array of objects. Output: one JSON line per object,
// {"kind", "name", "ok", "error"}. Exit status 1 when any object is invalid or unknown.
//
//   node deploy/ci/validate-crds.mjs < objects.json      (QTTS_DEPLOY_TOOLS: the tools folder)
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const tools = process.env.QTTS_DEPLOY_TOOLS;
if (!tools) {
  console.error("validate-crds: set QTTS_DEPLOY_TOOLS to the folder install-tools.sh filled");
  process.exit(2);
}
const objects = JSON.parse(readFileSync(0, "utf8"));
let failed = false;
for (const obj of objects) {
  const [group, version] = String(obj.apiVersion || "").split("/");
  const kind = String(obj.kind || "");
  const name = obj.metadata?.name ?? "";
  const file = join(tools, "node_modules", "@kubernetes-models", "prometheus-operator",
                    group ?? "", version ?? "", `${kind}.js`);
  let result;
  try {
    const mod = await import(pathToFileURL(file).href);
    const Model = mod[kind];
    new Model(obj).validate();
    result = { kind, name, ok: true, error: null };
  } catch (e) {
    result = { kind, name, ok: false, error: String(e && e.message ? e.message : e) };
    failed = true;
  }
  console.log(JSON.stringify(result));
}
process.exit(failed ? 1 : 0);
