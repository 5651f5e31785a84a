"""Writes to the status subresource (``PUT``, the patch kinds, server-side apply): they change
``.status`` alone, the field manager owning what it wrote in a ``managedFields`` entry with
``subresource: status``; an object of a CRD's kind is admitted again (its status schema)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .apply import server_side_apply, track_update
from .patches import APPLY, JSON_PATCH, STRATEGIC, json_patch, merge_patch, parse_body, patch_type
from .resources import Res, bad_request, clone, not_found, stale
from .store import Obj

if TYPE_CHECKING:
    from .ops import Api


def _expect(res: Res, name: str, old: Obj, body: Any) -> None:
    expect = ((body.get("metadata") or {}) if isinstance(body, dict) else {}).get("resourceVersion")
    if expect and expect != old["metadata"]["resourceVersion"]:
        raise stale(res, name)


def write(
    api: Api,
    res: Res,
    ns: str,
    name: str,
    raw: bytes,
    content_type: str | None,
    manager: str | None,
    force: bool = False,
) -> Obj:
    """The object after a write to ``{name}/status`` (``content_type`` None: a PUT)."""
    custom = res.kind in api.store.kinds.custom
    ctype = patch_type(content_type, custom) if content_type is not None else None
    body = parse_body(raw, yaml_ok=ctype == APPLY)
    store = api.store
    with store.lock:
        old = store.peek(res.kind, ns, name)
        if old is None:
            raise not_found(res, name)
        if ctype == APPLY:
            if not manager:
                raise bad_request("fieldManager is required for apply requests")
            config = api._check_type(res, body)
            _expect(res, name, old, config)
            config = {"status": config.get("status") or {}}
            new = server_side_apply(old, config, manager, force, res.api_version, "status")
        else:
            if ctype == JSON_PATCH:
                if not isinstance(body, list):
                    raise bad_request("json patch must be a list of operations")
                status = json_patch(old, body).get("status")
            elif isinstance(body, dict):
                _expect(res, name, old, body)
                patched = merge_patch(old, body, ctype == STRATEGIC) if ctype else body
                status = patched.get("status")
            else:
                raise bad_request(f"the body of the request was not a {res.kind} object")
            new = clone(old)
            new["status"] = clone(status) if status else {}
            if manager:
                track_update(old, new, manager, res.api_version, "status")
        if custom:
            api._custom(res, new)
        return store.update(new)
