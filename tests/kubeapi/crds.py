"""CustomResourceDefinitions (``apiextensions.k8s.io/v1``): what the API server checks on top
of the strict schema (names, versions, scope, a structural ``openAPIV3Schema``, printer
columns), defaulting, the status it writes (``NamesAccepted`` and ``Established``,
``acceptedNames``, ``storedVersions``) and, through a store listener, the ``Registry`` entry
that serves the CRD's kind once it is established (dropped when the CRD goes).

Simplified: objects are stored by kind, so a CRD whose kind is already served (built in, or
by another CRD) is not accepted (``NamesAccepted`` False, ``KindConflict``); the kind of an
established CRD cannot change; conversion between versions is always ``None`` (only
``apiVersion`` changes); CRD deletion is immediate and takes its objects with it."""

from __future__ import annotations

import re
from typing import Any

from .resources import BY_KIND, Custom, Registry, Res, invalid, now_iso
from .store import Obj, Store
from .validate import _DNS1035, _SUBDOMAIN, MSG_DNS1035, MSG_SUBDOMAIN, Cause

KIND = "CustomResourceDefinition"
CRD = BY_KIND[KIND]
SCOPES = ("Cluster", "Namespaced")
COLUMN_TYPES = ("boolean", "date", "integer", "number", "string")
FORBIDDEN = ("$ref", "$schema", "id", "patternProperties", "additionalItems", "definitions")
SCHEMA_KEYS = ("allOf", "anyOf", "oneOf", "not")


def attach(store: Store) -> None:
    """Keep ``store.kinds`` in step with the established CRDs."""

    def changed(kind: str, new: Obj | None, old: Obj | None) -> None:
        if kind != KIND:
            return
        crd = new if new is not None else old
        assert crd is not None
        if new is not None and established(new):
            store.kinds.put(custom_of(new))
        else:
            store.kinds.drop(crd["metadata"]["name"])

    store.listeners.append(changed)


def established(crd: Obj) -> bool:
    conds = (crd.get("status") or {}).get("conditions") or ()
    return any(c["type"] == "Established" and c["status"] == "True" for c in conds)


def custom_of(crd: Obj) -> Custom:
    spec = crd["spec"]
    names = spec["names"]
    versions, schemas = {}, {}
    for v in spec["versions"]:
        subs = ("status",) if "status" in (v.get("subresources") or {}) else ()
        versions[v["name"]] = Res(
            names["kind"],
            names["plural"],
            spec["group"],
            v["name"],
            spec["scope"] == "Namespaced",
            tuple(names.get("shortNames") or ()),
            subs,
            names.get("singular", ""),
            names.get("listKind", ""),
            tuple(names.get("categories") or ()),
        )
        schemas[v["name"]] = (v.get("schema") or {}).get("openAPIV3Schema") or {}
    storage = next(v["name"] for v in spec["versions"] if v.get("storage"))
    return Custom(
        crd=crd["metadata"]["name"],
        kind=names["kind"],
        storage=storage,
        versions=versions,
        served=tuple(v["name"] for v in spec["versions"] if v.get("served")),
        schemas=schemas,
        status=bool(versions[storage].subresources),
    )


def served_by(kinds: Registry, crd_name: str) -> Custom | None:
    return next((c for c in kinds.custom.values() if c.crd == crd_name), None)


# ---- admission: defaults, checks, status
def admit(new: Obj, old: Obj | None, kinds: Registry) -> None:
    """Default, check (``ApiError`` 422) and set the status of a CRD being written."""
    spec = new["spec"]
    names = spec["names"]
    if isinstance(names.get("kind"), str):
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", names["kind"] + "List")
    spec.setdefault("conversion", {"strategy": "None"})
    name = new["metadata"]["name"]
    causes = _spec_causes(name, spec) + _old_causes(spec, old)
    if causes:
        raise invalid(CRD, name, causes)
    new["status"] = _status(new, old, kinds)


def _spec_causes(name: str, spec: dict[str, Any]) -> list[Cause]:
    out: list[Cause] = []
    group, names = spec.get("group", ""), spec["names"]
    plural = names.get("plural", "")
    if name != f"{plural}.{group}":
        msg = f'Invalid value: "{name}": must be spec.names.plural+"."+spec.group'
        out.append(("metadata.name", msg, "FieldValueInvalid"))
    if not re.fullmatch(_SUBDOMAIN, group) or len(group) > 253:
        out.append(
            ("spec.group", f'Invalid value: "{group}": {MSG_SUBDOMAIN}', "FieldValueInvalid")
        )
    elif "." not in group:
        msg = f'Invalid value: "{group}": should be a domain with at least one dot'
        out.append(("spec.group", msg, "FieldValueInvalid"))
    if spec.get("scope") not in SCOPES:
        msg = f'Unsupported value: "{spec.get("scope")}": supported values: "Cluster", "Namespaced"'
        out.append(("spec.scope", msg, "FieldValueNotSupported"))
    for field in ("plural", "singular"):
        out += _label("spec.names." + field, names.get(field, ""), field == "plural")
    for i, short in enumerate(names.get("shortNames") or ()):
        out += _label(f"spec.names.shortNames[{i}]", short, True)
    for field in ("kind", "listKind"):
        value = names.get(field, "")
        if not value:
            out.append((f"spec.names.{field}", "Required value", "FieldValueRequired"))
        elif not re.fullmatch(_DNS1035, value.lower()):
            msg = f'Invalid value: "{value}": may have mixed case, but should otherwise match: '
            out.append((f"spec.names.{field}", msg + MSG_DNS1035, "FieldValueInvalid"))
    if names.get("kind") and names.get("kind") == names.get("listKind"):
        msg = f'Invalid value: "{names["listKind"]}": kind and listKind may not be the same'
        out.append(("spec.names.listKind", msg, "FieldValueInvalid"))
    return out + _versions_causes(spec.get("versions") or [])


def _label(field: str, value: str, required: bool) -> list[Cause]:
    if not value:
        return [(field, "Required value", "FieldValueRequired")] if required else []
    if re.fullmatch(_DNS1035, value) and len(value) <= 63:
        return []
    return [(field, f'Invalid value: "{value}": {MSG_DNS1035}', "FieldValueInvalid")]


def _versions_causes(versions: list[dict[str, Any]]) -> list[Cause]:
    out: list[Cause] = []
    if not versions:
        return [("spec.versions", "Required value: must have at least one version", "Required")]
    if sum(bool(v.get("storage")) for v in versions) != 1:
        msg = "Invalid value: ...: must have exactly one version marked as storage version"
        out.append(("spec.versions", msg, "FieldValueInvalid"))
    if not any(v.get("served") for v in versions):
        msg = "Invalid value: ...: must have at least one version marked as served"
        out.append(("spec.versions", msg, "FieldValueInvalid"))
    seen: set[str] = set()
    for i, v in enumerate(versions):
        where = f"spec.versions[{i}]"
        out += _label(f"{where}.name", v.get("name", ""), True)
        if v.get("name") in seen:
            out.append((f"{where}.name", f'Duplicate value: "{v["name"]}"', "FieldValueDuplicate"))
        seen.add(v.get("name", ""))
        schema = (v.get("schema") or {}).get("openAPIV3Schema")
        field = f"{where}.schema.openAPIV3Schema"
        if not isinstance(schema, dict):
            out.append((field, "Required value: schemas are required", "FieldValueRequired"))
        else:
            out += structural(schema, field, root=True)
        for j, col in enumerate(v.get("additionalPrinterColumns") or ()):
            out += _column(col, f"{where}.additionalPrinterColumns[{j}]")
    return out


def _column(col: dict[str, Any], where: str) -> list[Cause]:
    out: list[Cause] = []
    if col.get("type") not in COLUMN_TYPES:
        supported = ", ".join(f'"{t}"' for t in COLUMN_TYPES)
        msg = f'Unsupported value: "{col.get("type", "")}": supported values: {supported}'
        out.append((f"{where}.type", msg, "FieldValueNotSupported"))
    path = col.get("jsonPath", "")
    if not path:
        out.append((f"{where}.jsonPath", "Required value", "FieldValueRequired"))
    elif not path.startswith("."):
        msg = f'Invalid value: "{path}": must be a simple json path starting with .'
        out.append((f"{where}.jsonPath", msg, "FieldValueInvalid"))
    return out


def structural(
    node: dict[str, Any], field: str, root: bool = False, typed: bool = True
) -> list[Cause]:
    """Why ``node`` is not a structural schema (``typed``: part of the structure, where every
    node needs a ``type``; nodes under allOf/anyOf/oneOf/not only validate values)."""
    out: list[Cause] = []
    for key in (k for k in FORBIDDEN if k in node):
        out.append((f"{field}.{key}", f"Forbidden: {key} is not supported", "FieldValueForbidden"))
    if node.get("uniqueItems") is True:
        msg = "Forbidden: uniqueItems cannot be set to true since the runtime complexity "
        msg += "becomes quadratic"
        out.append((f"{field}.uniqueItems", msg, "FieldValueForbidden"))
    if node.get("x-kubernetes-preserve-unknown-fields") is False:
        msg = "Invalid value: false: must be true or undefined"
        out.append((f"{field}.x-kubernetes-preserve-unknown-fields", msg, "FieldValueInvalid"))
    kind, where = node.get("type"), f"{field}.type"
    loose = node.get("x-kubernetes-int-or-string") is True
    if root and not kind:
        out.append((where, "Required value: must not be empty at the root", "FieldValueRequired"))
    elif root and kind != "object":
        msg = f'Invalid value: "{kind}": must be object at the root'
        out.append((where, msg, "FieldValueInvalid"))
    elif loose and kind:
        msg = f'Invalid value: "{kind}": must be empty to be structural'
        out.append((where, msg, "FieldValueInvalid"))
    elif typed and not (kind or loose or node.get("x-kubernetes-preserve-unknown-fields")):
        msg = "Required value: must not be empty for specified object fields"
        out.append((where, msg, "FieldValueRequired"))
    props, extra = node.get("properties"), node.get("additionalProperties")
    if props and extra is not None:
        msg = "Forbidden: additionalProperties and properties are mutual exclusive"
        out.append((f"{field}.additionalProperties", msg, "FieldValueForbidden"))
    if kind == "array" and not isinstance(node.get("items"), dict):
        out.append((f"{field}.items", "Required value: must be specified", "FieldValueRequired"))
    if root and isinstance((props or {}).get("metadata"), dict):
        meta = props["metadata"]
        allowed = {"type", "description", "properties"}
        if set(meta) - allowed or set(meta.get("properties") or {}) - {"name", "generateName"}:
            msg = "Forbidden: must not specify anything other than name and generateName, but "
            msg += "metadata is implicitly specified"
            out.append((f"{field}.properties[metadata]", msg, "FieldValueForbidden"))
    for name, sub in (props or {}).items():
        if isinstance(sub, dict):
            out += structural(sub, f"{field}.properties[{name}]", typed=typed)
    if isinstance(extra, dict):
        out += structural(extra, f"{field}.additionalProperties", typed=typed)
    if isinstance(node.get("items"), dict):
        out += structural(node["items"], f"{field}.items", typed=typed)
    for key in SCHEMA_KEYS:
        subs = node.get(key)
        if isinstance(subs, dict):
            out += structural(subs, f"{field}.{key}", typed=False)
        for i, sub in enumerate(subs if isinstance(subs, list) else ()):
            out += structural(sub, f"{field}.{key}[{i}]", typed=False)
    return out


def _old_causes(spec: dict[str, Any], old: Obj | None) -> list[Cause]:
    out: list[Cause] = []
    if old is None:
        return out
    before = old["spec"]
    for field, a, b in (
        ("spec.group", before.get("group"), spec.get("group")),
        ("spec.scope", before.get("scope"), spec.get("scope")),
        ("spec.names.kind", before["names"].get("kind"), spec["names"].get("kind")),
    ):
        if a != b:
            out.append((field, f'Invalid value: "{b}": field is immutable', "FieldValueInvalid"))
    names = {v.get("name") for v in spec.get("versions") or ()}
    for i, v in enumerate((old.get("status") or {}).get("storedVersions") or ()):
        if v not in names:
            msg = f'Invalid value: "{v}": must appear in spec.versions'
            out.append((f"status.storedVersions[{i}]", msg, "FieldValueInvalid"))
    return out


def _conflict(name: str, spec: dict[str, Any], kinds: Registry) -> tuple[str, str] | None:
    names = spec["names"]
    kind = names["kind"]
    others = [c for c in kinds.custom.values() if c.crd != name]
    if kind in BY_KIND or any(c.kind == kind for c in others):
        return "KindConflict", f'"{kind}" is already in use'
    taken = {s for c in others if c.res.group == spec["group"] for s in c.res.short}
    for short in names.get("shortNames") or ():
        if short in taken:
            return "ShortNamesConflict", f'"{short}" is already in use'
    return None


def _condition(kind: str, ok: bool, reason: str, message: str, old: list[Any]) -> dict[str, Any]:
    status = "True" if ok else "False"
    was = next((c for c in old if c.get("type") == kind), None)
    since = was["lastTransitionTime"] if was and was.get("status") == status else now_iso()
    return {
        "type": kind,
        "status": status,
        "lastTransitionTime": since,
        "reason": reason,
        "message": message,
    }


def _status(new: Obj, old: Obj | None, kinds: Registry) -> dict[str, Any]:
    spec, name = new["spec"], new["metadata"]["name"]
    before = (old or {}).get("status") or {}
    stored = list(before.get("storedVersions") or ())
    storage = next(v["name"] for v in spec["versions"] if v.get("storage"))
    if storage not in stored:
        stored.append(storage)
    conds = before.get("conditions") or []
    conflict = _conflict(name, spec, kinds)
    if conflict is not None:
        accepted = before.get("acceptedNames") or {"plural": "", "kind": ""}
        conditions = [
            _condition("NamesAccepted", False, *conflict, conds),
            _condition("Established", False, "NotAccepted", "not all names are accepted", conds),
        ]
    else:
        names = spec["names"]
        keys = ("plural", "singular", "shortNames", "kind", "listKind", "categories")
        accepted = {k: names[k] for k in keys if names.get(k)}
        conditions = [
            _condition("NamesAccepted", True, "NoConflicts", "no conflicts found", conds),
            _condition(
                "Established",
                True,
                "InitialNamesAccepted",
                "the initial names have been accepted",
                conds,
            ),
        ]
    return {"conditions": conditions, "acceptedNames": accepted, "storedVersions": stored}
