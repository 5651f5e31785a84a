"""Validation of objects before they are stored.

The schema check is ``kubernetes_validate.validate(obj, "1.30", strict=True)`` made cheap:
the package's strict schema for a kind (``additionalProperties: false`` everywhere) is loaded
once, its ``$ref``s into ``_definitions.json`` inlined, and a jsonschema Draft 2020-12
validator kept per (version, kind), so the same errors come out at well under a millisecond
per object. On top come the checks of the real API server that a schema cannot express
(names, labels, selectors, restart policies, immutable fields, quantities)."""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from typing import Any

import importlib_resources
import jsonschema
from referencing import Registry, Resource

from .resources import BY_KIND, bad_request, invalid

VERSION = "1.30"
Cause = tuple[str, str, str]  # field, message, reason

_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1035 = r"[a-z]([-a-z0-9]*[a-z0-9])?"
_QUALIFIED = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_QUANTITY = re.compile(
    r"^[+-]?(\d+(\.\d*)?|\.\d+)(([eE][+-]?\d+)|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$"
)
MSG_SUBDOMAIN = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
    "'-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', "
    f"regex used for validation is '{_SUBDOMAIN}')"
)
MSG_LABEL = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
    f"regex used for validation is '{_LABEL}')"
)
MSG_DNS1035 = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with "
    "an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
    f"'abc-123', regex used for validation is '{_DNS1035}')"
)
MSG_ENV = (
    "a valid environment variable name must consist of alphabetic characters, digits, '_', "
    "'-', or '.', and must not start with a digit"
)
MSG_QUANTITY = (
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)
MSG_KEY = "a valid config key must consist of alphanumeric characters, '-', '_' or '.'"


def _inline(node: Any, defs: dict[str, Any], stack: tuple[str, ...] = ()) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            name = ref.rsplit("/", 1)[1]
            if name in stack:
                raise RecursionError(name)
            target = _inline(defs[name], defs, (*stack, name))
            rest = {k: v for k, v in node.items() if k != "$ref" and k != "description"}
            if any(not k.startswith("x-") for k in rest):
                return {"allOf": [target], **rest}
            return target
        return {k: _inline(v, defs, stack) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs, stack) for v in node]
    return node


@functools.cache
def _definitions(version: str) -> dict[str, Any]:
    return json.loads(_schema_dir(version).joinpath("_definitions.json").read_text())


def _schema_dir(version: str) -> Any:
    root = importlib_resources.files("kubernetes_validate").joinpath("kubernetes-json-schema")
    return root.joinpath(f"v{version}.0-local-strict")


@functools.cache
def validator(version: str, kind: str, api_version: str) -> jsonschema.Draft202012Validator:
    """The strict schema validator of ``kind``, built once (same file kubernetes_validate reads)."""
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = json.loads(_schema_dir(version).joinpath(f"{kind.lower()}-{group}.json").read_text())
    defs = _definitions(version)
    try:
        return jsonschema.Draft202012Validator(_inline(schema, defs["$defs"]))
    except RecursionError:
        registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
        return jsonschema.Draft202012Validator(schema, registry=registry)


def _field(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out


_VALID: set[str] = set()  # bodies already found valid (a re-apply of the same config is common)


def schema_causes(obj: dict[str, Any]) -> list[Cause]:
    """The strict-schema errors of ``obj`` (status and managedFields are not checked)."""
    meta = {k: v for k, v in obj.get("metadata", {}).items() if k != "managedFields"}
    body = {k: v for k, v in obj.items() if k != "status"}
    body["metadata"] = meta
    digest = json.dumps(body, sort_keys=True, separators=(",", ":"))
    if digest in _VALID:
        return []
    check = validator(VERSION, obj["kind"], obj["apiVersion"])
    errors = sorted(check.iter_errors(body), key=lambda e: list(map(str, e.absolute_path)))
    if not errors:
        if len(_VALID) >= 4096:
            _VALID.clear()
        _VALID.add(digest)
    return [(_field(e.absolute_path), e.message, "FieldValueInvalid") for e in errors[:20]]


def _name_causes(kind: str, name: str, field: str = "metadata.name") -> list[Cause]:
    if kind in ("Namespace",):
        pattern, msg, limit = _LABEL, MSG_LABEL, 63
    elif kind == "Service":
        pattern, msg, limit = _DNS1035, MSG_DNS1035, 63
    else:
        pattern, msg, limit = _SUBDOMAIN, MSG_SUBDOMAIN, 253
    out = []
    if len(name) > limit:
        out.append(
            (
                field,
                f'Invalid value: "{name}": must be no more than {limit} characters',
                "FieldValueInvalid",
            )
        )
    if not re.fullmatch(pattern, name):
        out.append((field, f'Invalid value: "{name}": {msg}', "FieldValueInvalid"))
    return out


def _label_causes(labels: dict[str, Any] | None, field: str, values: bool = True) -> list[Cause]:
    out: list[Cause] = []
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        bad = len(name) > 63 or not re.fullmatch(_QUALIFIED, name)
        bad = bad or bool(prefix and (len(prefix) > 253 or not re.fullmatch(_SUBDOMAIN, prefix)))
        if bad:
            msg = f'Invalid value: "{key}": name part must consist of alphanumeric characters, '
            msg += "'-', '_' or '.', and must start and end with an alphanumeric character"
            out.append((field, msg, "FieldValueInvalid"))
        if (
            values
            and isinstance(value, str)
            and (len(value) > 63 or (value and not re.fullmatch(_QUALIFIED, value)))
        ):
            msg = f'Invalid value: "{value}": a valid label must be an empty string or consist of '
            msg += "alphanumeric characters, '-', '_' or '.', and must start and end with an "
            msg += "alphanumeric character, and be no more than 63 characters"
            out.append((f"{field}", msg, "FieldValueInvalid"))
    return out


def _pod_causes(spec: dict[str, Any], field: str, restart: tuple[str, ...]) -> list[Cause]:
    out: list[Cause] = []
    policy = spec.get("restartPolicy")
    if restart and policy not in restart:
        supported = ", ".join(f'"{p}"' for p in restart)
        if policy is None:
            out.append(
                (
                    f"{field}.restartPolicy",
                    f"Required value: valid values: {supported}",
                    "FieldValueRequired",
                )
            )
        else:
            msg = f'Unsupported value: "{policy}": supported values: {supported}'
            out.append((f"{field}.restartPolicy", msg, "FieldValueNotSupported"))
    seen: set[str] = set()
    for group in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(group) or ()):
            where = f"{field}.{group}[{i}]"
            name = c.get("name", "")
            if name in seen:
                out.append((f"{where}.name", f'Duplicate value: "{name}"', "FieldValueDuplicate"))
            seen.add(name)
            if not re.fullmatch(_LABEL, name) or len(name) > 63:
                out.append(
                    (f"{where}.name", f'Invalid value: "{name}": {MSG_LABEL}', "FieldValueInvalid")
                )
            if not c.get("image"):
                out.append((f"{where}.image", "Required value", "FieldValueRequired"))
            for j, env in enumerate(c.get("env") or ()):
                if not re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", env.get("name", "")):
                    msg = f'Invalid value: "{env.get("name")}": {MSG_ENV}'
                    out.append((f"{where}.env[{j}].name", msg, "FieldValueInvalid"))
    if not spec.get("containers"):
        out.append((f"{field}.containers", "Required value", "FieldValueRequired"))
    return out


def check_quantities(obj: dict[str, Any]) -> None:
    """Unparseable quantities fail decoding in the real server: 400, not 422."""

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("limits", "requests") and isinstance(v, dict):
                    for q in v.values():
                        if not _QUANTITY.match(str(q)):
                            kind = obj["kind"]
                            why = f"cannot be handled as a {kind}: {MSG_QUANTITY}"
                            raise bad_request(f'{kind} in version "v1" {why}')
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(obj.get("spec"))


def _immutable(old: dict[str, Any] | None, new: dict[str, Any], *paths: str) -> list[Cause]:
    out: list[Cause] = []
    for path in paths:
        a, b = old, new
        for part in path.split("."):
            a = a.get(part) if isinstance(a, dict) else None
            b = b.get(part) if isinstance(b, dict) else None
        if old is not None and a != b:
            out.append((path, "Invalid value: ...: field is immutable", "FieldValueInvalid"))
    return out


def validate(obj: dict[str, Any], old: dict[str, Any] | None = None) -> None:
    """Raise ``ApiError`` (422 Invalid, or 400) when the real server would refuse ``obj``."""
    kind = obj["kind"]
    res = BY_KIND[kind]
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    check_quantities(obj)
    if kind == "Secret":
        for key, value in (obj.get("data") or {}).items():
            try:
                base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as exc:
                msg = f"illegal base64 data in {key}"
                raise bad_request(
                    f'Secret in version "v1" cannot be handled as a Secret: {msg}'
                ) from exc
    causes = schema_causes(obj)
    causes += _name_causes(kind, name)
    causes += _label_causes(meta.get("labels"), "metadata.labels")
    causes += _label_causes(meta.get("annotations"), "metadata.annotations", values=False)
    spec = obj.get("spec") or {}
    if kind == "Deployment" and not causes:
        causes += _deployment_causes(spec)
        causes += _immutable(old, obj, "spec.selector")
    elif kind == "Job" and not causes:
        causes += _pod_causes(
            spec["template"].get("spec") or {}, "spec.template.spec", ("OnFailure", "Never")
        )
        causes += _immutable(old, obj, "spec.selector", "spec.template")
    elif kind == "CronJob" and not causes:
        job_spec = spec["jobTemplate"].get("spec") or {}
        tpl = (job_spec.get("template") or {}).get("spec") or {}
        causes += _pod_causes(tpl, "spec.jobTemplate.spec.template.spec", ("OnFailure", "Never"))
    elif kind == "Pod" and not causes:
        causes += _pod_causes(spec, "spec", ())
    elif kind == "Service" and not causes:
        ports = spec.get("ports") or ()
        if len(ports) > 1 and any(not p.get("name") for p in ports):
            causes.append(("spec.ports[0].name", "Required value", "FieldValueRequired"))
    elif kind in ("ConfigMap", "Secret"):
        for key in list(obj.get("data") or ()) + list(obj.get("binaryData") or ()):
            if not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
                msg = f'Invalid value: "{key}": {MSG_KEY}'
                causes.append((f"data[{key}]", msg, "FieldValueInvalid"))
    if causes:
        raise invalid(res, name, causes)


def _deployment_causes(spec: dict[str, Any]) -> list[Cause]:
    from .store import matches, selector_reqs

    out: list[Cause] = []
    selector = spec.get("selector") or {}
    labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        out.append(
            (
                "spec.selector",
                "Invalid value: v1.LabelSelector{}: empty selector is invalid for deployment",
                "FieldValueInvalid",
            )
        )
    elif not matches(selector_reqs(selector), labels):
        msg = "Invalid value: map[string]string{...}: `selector` does not match template `labels`"
        out.append(("spec.template.metadata.labels", msg, "FieldValueInvalid"))
    if (spec.get("replicas") or 0) < 0:
        msg = f"Invalid value: {spec['replicas']}: must be greater than or equal to 0"
        out.append(("spec.replicas", msg, "FieldValueInvalid"))
    out += _pod_causes(
        (spec.get("template") or {}).get("spec") or {}, "spec.template.spec", ("Always",)
    )
    return out
