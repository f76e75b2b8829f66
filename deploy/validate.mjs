// Validates rendered Kubernetes manifests offline against the Kubernetes API schemas
// (the kubernetes-models package), the way an API server would before admitting them.
//
// Usage: node deploy/validate.mjs FILE.yaml...   ("-" reads standard input)
// Every document must be an object of a kind kubernetes-models knows. Besides the schema
// (types, required fields, formats such as quantities), fields the schema does not define are
// errors: `kubectl apply` would drop or reject them, so a typo such as `appprotocol` must not
// pass. Exits 0 when every object is valid, 1 otherwise, printing one line per problem.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const toolsDir = process.env.KVRECALL_TOOLS_DIR ?? path.join(repoRoot, ".tools");
const requireTool = createRequire(path.join(toolsDir, "node_modules", "_"));
const { parseAllDocuments } = requireTool("yaml");

// API groups of custom resources the chart may render, and the kubernetes-models package that
// holds their schemas (the Prometheus Operator's ServiceMonitor).
const customResourcePackages = {
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
};

// Loads the kubernetes-models class for an object: apiVersion "apps/v1" + kind "StatefulSet"
// lives at kubernetes-models/apps/v1/StatefulSet, core "v1" at kubernetes-models/v1/<Kind>,
// a custom resource's at <its package>/<group>/<version>/<Kind>.
function modelClass(apiVersion, kind) {
  if (!/^[a-z0-9.]+(\/[a-z0-9]+)?$/.test(apiVersion) || !/^[A-Z][A-Za-z0-9]*$/.test(kind)) {
    throw new Error(`apiVersion ${JSON.stringify(apiVersion)} / kind ${JSON.stringify(kind)} is malformed`);
  }
  const modelsPackage = customResourcePackages[apiVersion.split("/")[0]] ?? "kubernetes-models";
  let module;
  try {
    module = requireTool(`${modelsPackage}/${apiVersion}/${kind}`);
  } catch (error) {
    if (error.code !== "MODULE_NOT_FOUND") throw error;  // a broken install, not an unknown kind
    throw new Error(`no schema for ${apiVersion} ${kind} in ${modelsPackage}`);
  }
  return module[kind];
}

const fieldPath = (where, key) => (where === "" ? key : `${where}.${key}`);

// Wraps `value` so that every property the schema validator reads is recorded. The validator
// (ajv, compiled) reads each property its schema defines, and enumerates the keys only of maps
// (labels, limits, ...). An own property of a non-map object that was never read is therefore
// not in the schema.
function trackReads(value, where, records) {
  if (value === null || typeof value !== "object") return value;
  const record = { where, value, read: new Set(), enumerated: false };
  records.push(record);
  const children = new Map();
  return new Proxy(value, {
    get(target, key, receiver) {
      if (typeof key !== "string") return Reflect.get(target, key, receiver);
      record.read.add(key);
      const child = target[key];
      if (child === null || typeof child !== "object") return child;
      if (!children.has(key)) children.set(key, trackReads(child, fieldPath(where, key), records));
      return children.get(key);
    },
    has(target, key) {
      if (typeof key === "string") record.read.add(key);
      return Reflect.has(target, key);
    },
    ownKeys(target) {
      record.enumerated = true;
      return Reflect.ownKeys(target);
    },
  });
}

function unknownFields(Model, object) {
  const records = [];
  // The schema check proper already passed; this run only observes which fields it reads.
  Model.prototype.validate.call(trackReads(object, "", records));
  const problems = [];
  for (const { where, value, read, enumerated } of records) {
    if (Array.isArray(value) || enumerated) continue;
    for (const key of Object.keys(value)) {
      if (!read.has(key)) problems.push(`${fieldPath(where, key)}: field not in the schema`);
    }
  }
  return problems;
}

function validateObject(object) {
  if (object === null || typeof object !== "object" || Array.isArray(object)) {
    return ["document is not an object"];
  }
  const Model = modelClass(object.apiVersion, object.kind);
  try {
    new Model(object).validate();
  } catch (error) {
    return [error.message];
  }
  const problems = unknownFields(Model, object);
  if (!object.metadata?.name) problems.push("metadata.name is missing");
  return problems;
}

const files = process.argv.slice(2);
if (files.length === 0) {
  console.error("usage: node deploy/validate.mjs FILE.yaml... (- for standard input)");
  process.exit(2);
}
let failures = 0;
let objects = 0;
const seen = new Set();
for (const file of files) {
  const text = readFileSync(file === "-" ? 0 : file, "utf8");
  for (const document of parseAllDocuments(text)) {
    if (document.errors.length > 0) {
      for (const error of document.errors) console.log(`${file}: YAML: ${error.message}`);
      failures++;
      continue;
    }
    const object = document.toJS();
    if (object === null) continue;  // an empty document, e.g. a template that rendered nothing
    const name = `${object?.kind ?? "?"}/${object?.metadata?.name ?? "?"}`;
    let problems;
    try {
      problems = validateObject(object);
    } catch (error) {
      problems = [error.message];
    }
    if (seen.has(`${file} ${name}`)) problems.push("a second object of this kind and name");
    seen.add(`${file} ${name}`);
    objects++;
    for (const problem of problems) console.log(`${file}: ${name}: ${problem}`);
    if (problems.length > 0) failures++;
  }
}
console.log(`${objects} objects checked, ${failures} invalid`);
process.exit(failures === 0 && objects > 0 ? 0 : 1);
