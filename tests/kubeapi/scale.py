"""The scale subresource of Deployments (``deployments/{name}/scale``) as the real server
serves it: an ``autoscaling/v1`` ``Scale`` (``spec.replicas`` is the Deployment's,
``status.replicas`` the pods it has, ``status.selector`` its selector as a string), with the
Deployment's name, namespace, uid, resourceVersion and creationTimestamp. ``PUT``, the patch
kinds and server-side apply of it change the Deployment's ``spec.replicas`` alone (a new
generation and resourceVersion, a watch event, then the controller's pods); the writer owns
``spec.replicas`` in a ``managedFields`` entry with ``subresource: scale``, as real servers
record it since Kubernetes 1.22, taking it from the managers that owned it before."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .apply import conflict_error, from_fields, to_fields
from .patches import APPLY, JSON_PATCH, STRATEGIC, json_patch, merge_patch, parse_body, patch_type
from .resources import ApiError, Res, bad_request, clone, not_found, now_iso, stale
from .store import Obj
from .validate import validate

if TYPE_CHECKING:
    from .ops import Api

API_VERSION = "autoscaling/v1"
REPLICAS = ("spec", "replicas")


def of(dep: Obj) -> Obj:
    """The ``Scale`` of a Deployment."""
    meta = dep["metadata"]
    labels = ((dep.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return {
        "kind": "Scale",
        "apiVersion": API_VERSION,
        "metadata": {
            k: meta[k]
            for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if k in meta
        },
        "spec": {"replicas": int((dep.get("spec") or {}).get("replicas", 1))},
        "status": {
            "replicas": int((dep.get("status") or {}).get("replicas") or 0),
            "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
        },
    }


def read(api: Api, res: Res, ns: str, name: str) -> Obj:
    dep = api.store.get(res.kind, ns, name)
    if dep is None:
        raise not_found(res, name)
    return of(dep)


def write(
    api: Api,
    res: Res,
    ns: str,
    name: str,
    raw: bytes,
    content_type: str | None,
    manager: str,
    force: bool = False,
) -> Obj:
    """The ``Scale`` after a write to ``{name}/scale`` (``content_type`` None: a PUT)."""
    ctype = patch_type(content_type) if content_type is not None else None
    body = parse_body(raw, yaml_ok=ctype == APPLY)
    store = api.store
    with store.lock:
        old = store.peek(res.kind, ns, name)
        if old is None:
            raise not_found(res, name)
        current = of(old)
        if ctype == JSON_PATCH:
            if not isinstance(body, list):
                raise bad_request("json patch must be a list of operations")
            wanted = json_patch(current, body)
        elif ctype in (None, APPLY):
            wanted = _scale_body(body, name)
        else:
            if not isinstance(body, dict):
                raise bad_request("patch must be a JSON object")
            wanted = merge_patch(current, body, strategic=ctype == STRATEGIC)
        expect = (wanted.get("metadata") or {}).get("resourceVersion")
        if ctype != JSON_PATCH and expect and expect != old["metadata"]["resourceVersion"]:
            raise stale(res, name)
        replicas = _replicas(wanted, name)
        new = clone(old)
        new["spec"]["replicas"] = replicas
        operation = "Apply" if ctype == APPLY else "Update"
        if ctype == APPLY and not manager:
            raise bad_request("fieldManager is required for apply requests")
        changed = replicas != current["spec"]["replicas"]
        new["metadata"]["managedFields"] = _owned(old, manager, operation, changed, force)
        validate(new, old)
        return of(store.update(new))


def _scale_body(body: Any, name: str) -> Obj:
    if not isinstance(body, dict) or body.get("kind") != "Scale":
        have = (
            f"{body.get('apiVersion', '')}, Kind={body.get('kind', '')}"
            if isinstance(body, dict)
            else ""
        )
        raise bad_request(
            f"the object provided is unrecognized ({have}) or does not match the expected "
            f"{API_VERSION}, Kind=Scale"
        )
    if body.get("apiVersion") != API_VERSION:
        raise bad_request(f"the API version in the data ({body.get('apiVersion')}) does not match")
    meta = body.get("metadata") or {}
    if meta.get("name", name) != name:
        raise bad_request(
            f"the name of the object ({meta['name']}) does not match the name on the URL ({name})"
        )
    return body


def _replicas(scale: Obj, name: str) -> int:
    value = (scale.get("spec") or {}).get("replicas", 0)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_request(f"spec.replicas: {value!r} is not an integer")
    if value < 0:
        cause = (
            "spec.replicas",
            f"Invalid value: {value}: must be greater than or equal to 0",
            "FieldValueInvalid",
        )
        raise ApiError(
            422,
            "Invalid",
            f'Scale.autoscaling "{name}" is invalid: {cause[0]}: {cause[1]}',
            {
                "name": name,
                "group": "autoscaling",
                "kind": "Scale",
                "causes": [{"reason": cause[2], "message": cause[1], "field": cause[0]}],
            },
        )
    return value


def _owned(old: Obj, manager: str, operation: str, changed: bool, force: bool) -> list[Any]:
    """The Deployment's managedFields once ``manager`` wrote its replicas through the scale
    subresource: it owns them from now on when they changed (or it applied them); the others
    lose them when they changed (an apply that would change what another owns conflicts,
    unless forced)."""
    entries = list(old["metadata"].get("managedFields") or [])
    main = [e for e in entries if e.get("subresource") in (None, "scale")]
    owners = [
        e
        for e in main
        if REPLICAS in from_fields(e.get("fieldsV1") or {})
        and (e.get("manager"), e.get("operation")) != (manager, operation)
    ]
    others = [e for e in owners if e.get("manager") != manager]
    if operation == "Apply" and changed and others and not force:
        raise conflict_error([(e, REPLICAS) for e in others])
    out: list[Any] = []
    mine: dict[str, Any] | None = None
    for e in entries:
        is_mine = (e.get("manager"), e.get("operation"), e.get("subresource")) == (
            manager,
            operation,
            "scale",
        )
        if is_mine:
            mine = e
            out.append(e)
        elif changed and e in owners:
            paths = from_fields(e.get("fieldsV1") or {}) - {REPLICAS}
            if paths:
                out.append(dict(e, fieldsV1=to_fields(paths)))
        else:
            out.append(e)
    if mine is None and (changed or operation == "Apply"):
        out.append(
            {
                "manager": manager,
                "operation": operation,
                "apiVersion": "apps/v1",
                "time": now_iso(),
                "fieldsType": "FieldsV1",
                "fieldsV1": to_fields({REPLICAS}),
                "subresource": "scale",
            }
        )
    elif mine is not None and changed:
        out[out.index(mine)] = dict(mine, time=now_iso(), fieldsV1=to_fields({REPLICAS}))
    return out
