// Validates Gateway API objects against the upstream CRD schemas, as published in
// @kubernetes-models/gateway-api (its models' validate()). Reads a JSON array of objects
// on stdin; prints a JSON array with, for each, null (valid) or the schema's complaint.
// Driven by the Python tests (tests/gateway_schema.py); npm ci in tests/ installs it.
import { Gateway } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/Gateway";
import { HTTPRoute } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute";

const MODELS = { Gateway, HTTPRoute };

function check(obj) {
  const Model = MODELS[obj && obj.kind];
  if (!Model) return `no model for kind ${JSON.stringify(obj && obj.kind)}`;
  if (obj.apiVersion !== Model.apiVersion) return `apiVersion must be ${Model.apiVersion}`;
  try {
    new Model(obj).validate();
    return null;
  } catch (err) {
    return String(err.message || err);
  }
}

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const objects = JSON.parse(Buffer.concat(chunks).toString("utf8"));
process.stdout.write(JSON.stringify(objects.map(check)) + "\n");
