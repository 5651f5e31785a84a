"""What a request path names: a resource (``Route``) or a discovery document, built from the
``Registry`` so that the kinds of established CustomResourceDefinitions are routed and
discovered like the built-in ones."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from .resources import VERBS, ApiError, Registry, Res

STATUS_VERBS = ["get", "patch", "update"]


class Route:
    """A resource path: ``res``, namespace, name, subresource, the rest (for proxy)."""

    def __init__(
        self, res: Res, ns: str | None, name: str | None, sub: str | None, tail: str
    ) -> None:
        self.res, self.ns, self.name, self.sub, self.tail = res, ns, name, sub, tail


def route(path: str, kinds: Registry) -> Route | dict[str, Any]:
    """A ``Route``, or the discovery document the path names; ``ApiError`` 404 otherwise."""
    parts = path.split("/")[1:]
    missing = ApiError(404, "NotFound", "the server could not find the requested resource", {})
    if parts[0] == "api":
        if len(parts) == 1 or parts[1] == "":
            return {"_discovery": "versions"}
        if parts[1] != "v1":
            raise missing
        group, version, rest = "", "v1", parts[2:]
    elif parts[0] == "apis":
        groups = kinds.groups()
        if len(parts) == 1 or parts[1] == "":
            return discovery_groups(groups)
        if parts[1] not in groups:
            raise missing
        if len(parts) == 2 or parts[2] == "":
            return dict(_group(parts[1], groups[parts[1]]), kind="APIGroup", apiVersion="v1")
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        raise missing
    if not rest or rest == [""]:
        doc = discovery_resources(kinds, group, version)
        if doc is None:
            raise missing
        return doc
    paths = kinds.paths
    ns = None
    if rest[0] == "namespaces" and len(rest) >= 3 and (group, version, rest[2]) in paths:
        ns, rest = unquote(rest[1]), rest[2:]
    res = paths.get((group, version, rest[0]))
    if res is None or (ns is not None and not res.namespaced):
        raise missing
    name = unquote(rest[1]) if len(rest) > 1 and rest[1] else None
    if res.namespaced and ns is None and name is not None:
        raise missing
    sub = rest[2] if len(rest) > 2 else None
    if sub is not None and (
        sub not in res.subresources or (sub not in ("proxy",) and len(rest) > 3)
    ):
        raise missing
    tail = "/" + "/".join(rest[3:])
    return Route(res, ns, name, sub, tail)


def _group(name: str, versions: list[str]) -> dict[str, Any]:
    gvs = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": gvs, "preferredVersion": gvs[0]}


def discovery_groups(groups: dict[str, list[str]]) -> dict[str, Any]:
    items = [_group(g, vs) for g, vs in groups.items()]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": items}


def discovery_resources(kinds: Registry, group: str, version: str) -> dict[str, Any] | None:
    """The ``APIResourceList`` for ``/api/v1`` or ``/apis/{group}/{version}``."""
    items = [r for r in kinds.resources() if r.group == group and r.version == version]
    if not items:
        return None
    resources: list[dict[str, Any]] = []
    for r in items:
        verbs = [v for v in VERBS if not (r.kind == "Namespace" and v == "deletecollection")]
        entry: dict[str, Any] = {
            "name": r.plural,
            "singularName": r.singular or r.kind.lower(),
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": verbs,
        }
        if r.short:
            entry["shortNames"] = list(r.short)
        if r.categories:
            entry["categories"] = list(r.categories)
        resources.append(entry)
        for sub in r.subresources:
            sub_verbs = {"status": STATUS_VERBS, "scale": STATUS_VERBS, "log": ["get"]}.get(
                sub, ["create", "delete", "get", "patch", "update"]
            )
            sub_kind = {"log": "Pod", "scale": "Scale"}.get(sub, r.kind)
            entry = {
                "name": f"{r.plural}/{sub}",
                "singularName": "",
                "namespaced": r.namespaced,
                "kind": sub_kind,
                "verbs": sub_verbs,
            }
            if sub == "scale":  # served as autoscaling/v1, whatever the group of the kind
                entry.update(group="autoscaling", version="v1")
            resources.append(entry)
    gv = f"{group}/{version}" if group else version
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": gv,
        "resources": resources,
    }


def discovery_versions(address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
    }
