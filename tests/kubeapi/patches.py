"""Request bodies (JSON, or YAML for apply) and the patch formats: JSON merge patch
(RFC 7386), strategic merge patch and JSON patch (RFC 6902). Strategic merge patch is a JSON
merge patch in which name-keyed lists merge by name and ``$patch: delete`` removes an item;
other directives are ignored."""

from __future__ import annotations

import json
from typing import Any

import yaml

from .apply import keyed
from .resources import ApiError, bad_request, clone

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def patch_type(content_type: str, custom: bool = False) -> str:
    """The patch format a Content-Type names; 415 for others (and for strategic merge patch
    of a CRD's kind, which has no patch strategies)."""
    ctype = content_type.split(";")[0].strip().lower()
    accepted = (JSON_PATCH, MERGE, APPLY) if custom else (JSON_PATCH, MERGE, APPLY, STRATEGIC)
    if ctype not in accepted:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            "the body of the request was in an unknown format - accepted media types include: "
            + ", ".join(accepted),
        )
    return ctype


def parse_body(raw: bytes, yaml_ok: bool = False) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError as exc:
        if yaml_ok:
            try:
                return yaml.safe_load(raw)
            except yaml.YAMLError:
                pass
        raise bad_request(f"the body of the request could not be decoded: {exc}") from exc


def merge_patch(target: Any, patch: Any, strategic: bool = False) -> Any:
    """RFC 7386 JSON merge patch (``strategic``: name-keyed lists merge by name)."""
    if not isinstance(patch, dict):
        return clone(patch)
    out = clone(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if strategic and k.startswith("$"):
            continue
        if v is None:
            out.pop(k, None)
        elif strategic and keyed(v) and (keyed(out.get(k)) or out.get(k) == []):
            items = {i["name"]: i for i in out[k]}
            order = [i["name"] for i in out[k]]
            for item in v:
                name = item["name"]
                if item.get("$patch") == "delete":
                    items.pop(name, None)
                    continue
                if name not in items:
                    order.append(name)
                items[name] = merge_patch(items.get(name), item, True)
            out[k] = [items[n] for n in order if n in items]
        else:
            out[k] = merge_patch(out.get(k), v, strategic)
    return out


def _pointer(doc: Any, pointer: str) -> tuple[Any, str | int]:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
    if not parts:
        raise bad_request("the root cannot be patched")
    for part in parts[:-1]:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    last = parts[-1]
    if isinstance(doc, list):
        return doc, len(doc) if last == "-" else int(last)
    return doc, last


def json_patch(target: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 JSON patch (add, remove, replace, move, copy, test)."""
    doc = clone(target)
    try:
        for op in ops:
            kind = op["op"]
            if kind in ("move", "copy"):
                src, skey = _pointer(doc, op["from"])
                value = src[skey]
                if kind == "move":
                    del src[skey]
                op = {"op": "add", "path": op["path"], "value": clone(value)}
                kind = "add"
            parent, key = _pointer(doc, op["path"])
            if kind == "test":
                if parent[key] != op["value"]:
                    raise bad_request(f"testing value {op['path']} failed")
            elif kind == "remove":
                del parent[key]
            elif kind == "add" and isinstance(parent, list):
                parent.insert(int(key), clone(op["value"]))
            elif kind in ("add", "replace"):
                if kind == "replace" and not isinstance(parent, list) and key not in parent:
                    raise bad_request(
                        f"replace operation does not apply: doc is missing key: {op['path']}"
                    )
                parent[key] = clone(op["value"])
            else:
                raise bad_request(f"Unexpected kind: {kind}")
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise bad_request(
            f"the server rejected our request due to an error in our request: {exc}"
        ) from exc
    return doc
