// validate.mjs checks the responses the Go HTTP tests recorded
// (DEVICEHUB_RECORD_RESPONSES, one JSON object a line: method, path,
// pattern, status, headers, body) against openapi.json:
//
//   - the record's ServeMux pattern names an operation of the doc
//     ("GET /{$}" is the doc's "GET /");
//   - its status is one the operation documents;
//   - every header the response documents as required is there, and
//     matches its schema;
//   - its Content-Type is one the response documents, and a JSON body
//     validates against that schema (JSON Schema 2020-12, through ajv);
//     a response documented without content has an empty body.
//
// Records the server answered before routing (pattern "": a path not in
// its clean form, a CORS preflight) or through the catch-all (pattern "/":
// unknown routes, wrong methods) are checked against the doc's
// `x-unrouted-responses`: a {message} body, Allow on a 405, the CORS
// headers and no body on a 204. It prints a summary line "N passed, M failed" and exits 1 on any
// failure, or when there is nothing to check.
//
// Usage: node validate.mjs <openapi.json> <records.jsonl>

import { readFileSync } from "node:fs";
import Ajv2020 from "ajv/dist/2020.js";
import addFormats from "ajv-formats";

const docID = "https://devicehub.invalid/openapi.json";
const methods = ["get", "put", "post", "delete", "options", "head", "patch", "trace"];

function main() {
  const [docPath, recordsPath] = process.argv.slice(2);
  if (!docPath || !recordsPath) {
    console.error("usage: node validate.mjs <openapi.json> <records.jsonl>");
    process.exit(2);
  }
  const doc = JSON.parse(readFileSync(docPath, "utf8"));
  const records = readRecords(recordsPath);
  const checker = newChecker(doc);
  let passed = 0;
  let failed = 0;
  let unrouted = 0;
  const seen = new Set();
  for (const rec of records) {
    const { problems, op } = checker.check(rec);
    if (op) seen.add(op);
    else unrouted++;
    if (problems.length === 0) {
      passed++;
      continue;
    }
    failed++;
    const excerpt = rec.body.length > 300 ? rec.body.slice(0, 300) + "…" : rec.body;
    console.log(`FAIL ${rec.method} ${rec.path} (pattern ${JSON.stringify(rec.pattern)}) ${rec.status}: ${problems.join("; ")}\n     body: ${excerpt}`);
  }
  const never = [...checker.operations.keys()].filter((op) => !seen.has(op));
  if (never.length > 0) {
    console.log(`note: ${never.length} documented operations have no recorded response: ${never.join(", ")}`);
  }
  if (records.length === 0) {
    console.log("no records: did the tests run with DEVICEHUB_RECORD_RESPONSES set?");
    failed++;
  }
  console.log(`${passed} passed, ${failed} failed (${records.length} recorded responses, ${unrouted} of them unrouted)`);
  process.exit(failed > 0 ? 1 : 0);
}

// readRecords parses the JSONL file; a line that is not a record is an error.
function readRecords(path) {
  return readFileSync(path, "utf8")
    .split("\n")
    .filter((line) => line.trim() !== "")
    .map((line, i) => {
      const rec = JSON.parse(line);
      for (const [k, t] of [["method", "string"], ["path", "string"], ["pattern", "string"], ["status", "number"], ["headers", "object"], ["body", "string"]]) {
        if (typeof rec[k] !== t) throw new Error(`${path}:${i + 1}: field ${k} is not a ${t}`);
      }
      return rec;
    });
}

// newChecker indexes the doc's operations by "METHOD /path" and compiles
// its schemas; check(rec) lists what is wrong with one record.
function newChecker(doc) {
  const ajv = new Ajv2020({ allErrors: true, strict: true, allowUnionTypes: true });
  addFormats(ajv);
  ajv.addFormat("binary", true); // OpenAPI's file marker in multipart schemas
  ajv.addSchema({ $id: docID, $defs: toDefs(doc.components?.schemas ?? {}) });
  for (const name of Object.keys(doc.components?.schemas ?? {})) {
    ajv.getSchema(`${docID}#/$defs/${name}`); // compiles it: a broken schema fails here, not later
  }
  const compiled = new Map();
  const validator = (schema) => {
    const key = JSON.stringify(schema);
    if (!compiled.has(key)) compiled.set(key, ajv.compile(toDefs(schema, docID)));
    return compiled.get(key);
  };

  const operations = new Map();
  for (const [path, item] of Object.entries(doc.paths ?? {})) {
    for (const m of methods) {
      if (item[m]) operations.set(`${m.toUpperCase()} ${path}`, item[m]);
    }
  }
  const unroutedResponses = doc["x-unrouted-responses"] ?? {};

  function check(rec) {
    if (rec.pattern === "" || rec.pattern === "/") {
      return { problems: checkResponse(rec, unroutedResponses, "unrouted"), op: null };
    }
    const op = patternOperation(rec.pattern);
    const operation = operations.get(op);
    if (!operation) return { problems: [`no operation ${op} in the doc`], op: null };
    return { problems: checkResponse(rec, operation.responses ?? {}, op), op };
  }

  function checkResponse(rec, responses, where) {
    const found = responses[String(rec.status)] ?? responses[`${String(rec.status)[0]}XX`];
    if (!found) return [`status ${rec.status} is not documented for ${where} (documented: ${Object.keys(responses).join(", ")})`];
    const response = deref(doc, found);
    return [...checkHeaders(rec, response), ...checkBody(rec, response)];
  }

  function checkHeaders(rec, response) {
    const problems = [];
    for (const [name, h] of Object.entries(response.headers ?? {})) {
      const header = deref(doc, h);
      const value = rec.headers[name.toLowerCase()];
      if (value === undefined) {
        if (header.required) problems.push(`required header ${name} is missing`);
        continue;
      }
      if (!header.schema) continue;
      const v = validator(header.schema);
      if (!v(headerValue(value, deref(doc, header.schema)))) {
        problems.push(`header ${name}: ${JSON.stringify(value)} ${ajv.errorsText(v.errors)}`);
      }
    }
    return problems;
  }

  function checkBody(rec, response) {
    if (!response.content) {
      return rec.body === "" ? [] : ["a body where the doc documents none"];
    }
    const type = (rec.headers["content-type"] ?? "").split(";")[0].trim();
    const media = response.content[type];
    if (!media) return [`Content-Type ${JSON.stringify(type)} is not documented (documented: ${Object.keys(response.content).join(", ")})`];
    if (!isJSON(type) || !media.schema) return [];
    let body;
    try {
      body = JSON.parse(rec.body);
    } catch (e) {
      return [`body is not JSON: ${e.message}`];
    }
    const v = validator(media.schema);
    return v(body) ? [] : [`body: ${ajv.errorsText(v.errors, { dataVar: "body" })}`];
  }

  return { check, operations };
}

// patternOperation is the doc operation a ServeMux pattern serves:
// "GET /{$}" is "GET /", "{name...}" is "{name}".
function patternOperation(pattern) {
  const [method, path] = pattern.split(" ", 2);
  return `${method} ${path.replace(/\{\$\}$/, "").replaceAll("...}", "}")}`;
}

// deref follows a $ref (into the doc) until it reaches an object without
// one; siblings of a $ref (3.1 allows a description) win over the target.
function deref(doc, obj) {
  let out = obj;
  for (let i = 0; out && out.$ref; i++) {
    if (i > 20 || !out.$ref.startsWith("#/")) throw new Error(`cannot follow $ref ${out.$ref}`);
    const { $ref, ...siblings } = out;
    const target = $ref.slice(2).split("/").reduce((o, k) => o?.[k.replaceAll("~1", "/").replaceAll("~0", "~")], doc);
    if (target === undefined) throw new Error(`$ref ${$ref} points nowhere`);
    out = { ...target, ...siblings };
  }
  return out;
}

// toDefs copies a schema with "#/components/schemas/X" references turned
// into "<base>#/$defs/X", so that ajv resolves them in the schema that
// addSchema registered under docID.
function toDefs(schema, base = "") {
  if (Array.isArray(schema)) return schema.map((s) => toDefs(s, base));
  if (schema === null || typeof schema !== "object") return schema;
  const out = {};
  for (const [k, v] of Object.entries(schema)) {
    out[k] = k === "$ref" && typeof v === "string" ? v.replace(/^#\/components\/schemas\//, `${base}#/$defs/`) : toDefs(v, base);
  }
  return out;
}

// headerValue turns a header's text into the type its schema wants.
function headerValue(text, schema) {
  const types = [schema.type ?? []].flat();
  if ((types.includes("integer") || types.includes("number")) && /^-?\d+(\.\d+)?$/.test(text)) return Number(text);
  return text;
}

function isJSON(type) {
  return type === "application/json" || type.endsWith("+json");
}

try {
  main();
} catch (e) {
  console.error(`validate.mjs: ${e.message}`);
  process.exit(1);
}
