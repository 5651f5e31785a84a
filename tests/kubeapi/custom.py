"""Admission of custom resources, as the API server does it with a CRD version's structural
``openAPIV3Schema``: unknown fields are pruned (kept under
``x-kubernetes-preserve-unknown-fields: true``, and ``apiVersion``/``kind``/``metadata`` of
``x-kubernetes-embedded-resource`` objects), ``default``s filled in, then the object is
validated (jsonschema, draft 4 semantics as OpenAPI v3 has them, plus ``nullable`` and
``x-kubernetes-int-or-string``) and its metadata checked as ObjectMeta (strict schema, name a
DNS-1123 subdomain, labels, annotations). Errors read like the real server's.

Not evaluated: ``x-kubernetes-validations`` (CEL), ``format``, list-type uniqueness."""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema

from .resources import Custom, bad_request, clone, invalid
from .validate import VERSION, Cause, _definitions, _inline, _label_causes, _name_causes

OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
TOP = ("apiVersion", "kind", "metadata")
DOCS = ("description", "example", "default", "format", "nullable", "externalDocs", "title")
TYPE_NAMES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


def admit(custom: Custom, version: str, obj: dict[str, Any], validation: str | None) -> list[str]:
    """Prune, default and validate ``obj`` (in place) as version ``version`` of ``custom``;
    the warnings to send (``validation`` is the request's ``fieldValidation``)."""
    schema = custom.schemas.get(version) or {"type": "object"}
    unknown: list[str] = []
    prune(obj, schema, "", unknown, root=True)
    if unknown and validation == "Strict":
        fields = ", ".join(f'unknown field "{f}"' for f in unknown)
        raise bad_request(
            f'{custom.kind} in version "{version}" cannot be handled as a {custom.kind}: '
            f"strict decoding error: {fields}"
        )
    default(obj, schema)
    meta = obj.get("metadata") or {}
    causes = meta_causes(meta)
    causes += _name_causes(custom.kind, str(meta.get("name", "")))
    causes += _label_causes(meta.get("labels"), "metadata.labels")
    causes += _label_causes(meta.get("annotations"), "metadata.annotations", values=False)
    body = {k: v for k, v in obj.items() if k != "metadata"}
    body["metadata"] = {k: v for k, v in meta.items() if k in ("name", "generateName")}
    errors = sorted(_validator(_key(schema)).iter_errors(body), key=lambda e: _path(e.path))
    causes += [_cause(e) for e in errors[:20]]
    if causes:
        raise invalid(custom.versions[version], str(meta.get("name", "")), causes)
    if validation in ("Ignore", "Strict"):
        return []
    return [f'unknown field "{f}"' for f in unknown]


# ---- pruning and defaulting
def prune(
    value: Any, schema: dict[str, Any], path: str, out: list[str], root: bool = False
) -> None:
    """Drop the fields ``schema`` does not know (their paths go to ``out``)."""
    if isinstance(value, list):
        items = schema.get("items")
        for i, item in enumerate(value):
            if isinstance(items, dict):
                prune(item, items, f"{path}[{i}]", out)
        return
    if not isinstance(value, dict):
        return
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    keep = root or schema.get("x-kubernetes-embedded-resource")
    for k in list(value):
        sub = props.get(k)
        if keep and k in TOP and (k == "metadata" or sub is None):
            continue
        if sub is None and isinstance(extra, dict):
            sub = extra
        if sub is not None:
            prune(value[k], sub, f"{path}.{k}" if path else k, out)
        elif not (extra is True or schema.get("x-kubernetes-preserve-unknown-fields")):
            del value[k]
            out.append(f"{path}.{k}" if path else k)


def default(value: Any, schema: dict[str, Any]) -> None:
    """Fill in the ``default`` of every absent property (walking into what is present)."""
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            default(item, schema["items"])
    elif isinstance(value, dict):
        props = schema.get("properties") or {}
        for k, sub in props.items():
            if k not in value and "default" in sub:
                value[k] = clone(sub["default"])
        extra = schema.get("additionalProperties")
        for k, v in value.items():
            sub = props.get(k) or (extra if isinstance(extra, dict) else None)
            if sub is not None and k != "metadata":
                default(v, sub)


# ---- the schema as jsonschema
def to_jsonschema(node: Any) -> Any:
    """An OpenAPI v3 (Kubernetes flavour) schema as a draft 4 JSON schema."""
    if isinstance(node, list):
        return [to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in ("properties", "definitions"):
            out[k] = {name: to_jsonschema(s) for name, s in v.items()}
        elif k in ("items", "additionalProperties", "not", "allOf", "anyOf", "oneOf"):
            out[k] = to_jsonschema(v)
        elif k not in DOCS and not k.startswith("x-"):
            out[k] = v
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def _key(schema: dict[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True)


@functools.lru_cache(maxsize=256)
def _validator(key: str) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(to_jsonschema(json.loads(key)))


@functools.cache
def _meta_validator() -> jsonschema.Draft202012Validator:
    defs = _definitions(VERSION)["$defs"]
    return jsonschema.Draft202012Validator(_inline(defs[OBJECT_META], defs))


def meta_causes(meta: dict[str, Any]) -> list[Cause]:
    body = {k: v for k, v in meta.items() if k != "managedFields"}
    errors = sorted(_meta_validator().iter_errors(body), key=lambda e: _path(e.path))
    return [(_path(["metadata", *e.path]), e.message, "FieldValueInvalid") for e in errors]


# ---- errors like the real server's
def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out


def _go(value: Any) -> str:
    """A value as Go's ``%#v``-ish rendering in field errors shows it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value)
    return '"' + TYPE_NAMES.get(type(value), "object") + '"'


def _type_name(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return "number"
    return TYPE_NAMES.get(type(value), "object")


def _cause(e: jsonschema.ValidationError) -> Cause:
    path = _path(e.path)
    where = path or "<root>"
    v, arg, value = e.validator, e.validator_value, e.instance
    if v == "required":
        missing = e.message.split("'")[1] if "'" in e.message else ""
        return (f"{path}.{missing}" if path else missing, "Required value", "FieldValueRequired")
    if v == "type":
        t = _type_name(value)
        want = arg if isinstance(arg, str) else arg[0]
        msg = f'Invalid value: "{t}": {where} in body must be of type {want}: "{t}"'
        return (path, msg, "FieldValueTypeInvalid")
    if v == "enum":
        supported = ", ".join(_go(x) for x in arg)
        msg = f"Unsupported value: {_go(value)}: supported values: {supported}"
        return (path, msg, "FieldValueNotSupported")
    if v == "maxLength":
        return (path, f"Too long: may not be longer than {arg}", "FieldValueTooLong")
    if v in ("maxItems", "maxProperties"):
        return (path, f"Too many: {len(value)}: must have at most {arg} items", "FieldValueTooMany")
    exclusive = e.schema.get("exclusiveMinimum" if v == "minimum" else "exclusiveMaximum")
    texts = {
        "minimum": f"should be greater than {'' if exclusive else 'or equal to '}{arg}",
        "maximum": f"should be less than {'' if exclusive else 'or equal to '}{arg}",
        "minLength": f"should be at least {arg} chars long",
        "minItems": f"should have at least {arg} items",
        "minProperties": f"should have at least {arg} properties",
        "pattern": f"should match '{arg}'",
        "multipleOf": f"should be a multiple of {arg}",
    }
    text = f"{where} in body {texts[v]}" if v in texts else e.message
    return (path, f"Invalid value: {_go(value)}: {text}", "FieldValueInvalid")
