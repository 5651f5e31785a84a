"""A function's revisions as objects of their own: names, labels and what is rendered.

A kept revision, and a rollout's candidate, run beside the function as a unit
``name@id`` (the id from the revision's spec hash): a Deployment and a Service
named ``<name>-rev-<id>`` (at most 40 + 15 characters, within a DNS label's 63;
stable across restarts, since the id is), and with ``--gateway`` an HTTPRoute of
that name while the revision is warm. Their labels name the function and the
revision (``revision-of``, ``revision-id``) but never carry the function label:
the function's own Service selects its pods by that label, and must not reach a
revision's; prune and garbage collection tell them apart the same way.

A kept revision is autoscaled from zero to one replica (its first call starts it,
it stops after the function's idle time); a candidate runs as the function does.
Neither runs the function's cron triggers: the function's own objects do.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from ..manifests.model import Scale
from ..plan.backend import KeptRevision
from .renderer import (
    ENV_LABEL,
    FUNCTION_LABEL,
    MANAGED_BY,
    OBJECT_COUNT,
    SPEC_HASH,
    RenderConfig,
    render_function,
    render_http_route,
    spec_hash,
)

__all__ = [
    "REVISION_ID",
    "REVISION_OF",
    "is_candidate",
    "object_name",
    "pod_selector",
    "render_revision",
    "revision_route",
    "split_route",
    "unit_of",
]

REVISION_OF = "gitops-sless.dev/revision-of"
REVISION_ID = "gitops-sless.dev/revision-id"
CANDIDATE = "gitops-sless.dev/candidate"  # on a rollout's candidate's Deployment


def is_candidate(deployment: Mapping[str, Any] | None) -> bool:
    """Whether ``deployment`` is a rollout's candidate's (rendered as one)."""
    annotations = ((deployment or {}).get("metadata") or {}).get("annotations") or {}
    return annotations.get(CANDIDATE) == "true"


def object_name(unit: str) -> str:
    """The objects' name of a function (``name``) or of one of its revisions (``name@id``)."""
    name, at, revision = unit.partition("@")
    return f"{name}-rev-{revision}" if at else name


def unit_of(obj: Mapping[str, Any]) -> str | None:
    """Whose object ``obj`` is: its function's name, ``name@id`` for a revision's, or None."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    function = labels.get(FUNCTION_LABEL)
    if function:
        return str(function)
    of, revision = labels.get(REVISION_OF), labels.get(REVISION_ID)
    return f"{of}@{revision}" if of and revision else None


def pod_selector(env: str, unit: str) -> dict[str, str]:
    """The labels of the pods of a function or of one of its revisions."""
    name, at, revision = unit.partition("@")
    own = {REVISION_OF: name, REVISION_ID: revision} if at else {FUNCTION_LABEL: name}
    return {MANAGED_BY: "gitops-sless", ENV_LABEL: env, **own}


def render_revision(
    kept: KeptRevision, config: RenderConfig, image: str | None, candidate: bool
) -> list[dict[str, Any]]:
    """The Deployment and Service of ``kept``: autoscaled between zero and one replica, or
    (``candidate``) with the function's own replicas. No HTTPRoute: a revision has one
    only while warm (:func:`revision_route`), a candidate shares the function's."""
    deployment = kept.deployment
    fn = dataclasses.replace(deployment.function, crons=())
    if not candidate:
        at_zero = Scale(0, 1, idle_sec=fn.scale_in(deployment.env).idle_sec)
        fn = dataclasses.replace(fn, scale=at_zero, preview_scale=at_zero)
    no_gateway = dataclasses.replace(config, gateway=None)
    objects = render_function(dataclasses.replace(deployment, function=fn), no_gateway, None, image)
    unit = f"{deployment.name}@{kept.id}"
    own = {REVISION_OF: deployment.name, REVISION_ID: kept.id}
    for obj in objects:
        _relabel(obj, unit, own)
        spec = obj["spec"]
        if obj["kind"] == "Deployment":
            if candidate:  # a restart finds it as one (see ``is_candidate``)
                obj["metadata"]["annotations"][CANDIDATE] = "true"
            else:  # created at zero: no replica until its first call
                spec["replicas"] = 0
            spec["selector"]["matchLabels"] = dict(own)
            _relabel(spec["template"], unit, own)
            obj["metadata"]["annotations"].pop(OBJECT_COUNT, None)
        else:
            spec["selector"] = dict(own)
        obj["metadata"]["annotations"][SPEC_HASH] = spec_hash(obj)
    return objects


def _relabel(obj: dict[str, Any], unit: str, own: Mapping[str, str]) -> None:
    meta = obj.setdefault("metadata", {})
    if "name" in meta:
        meta["name"] = object_name(unit)
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k != FUNCTION_LABEL}
    meta["labels"] = {**labels, **own}


def revision_route(
    kept: KeptRevision, timeout_sec: int | str, config: RenderConfig
) -> dict[str, Any]:
    """With ``--gateway``, the HTTPRoute of a warm revision: ``/fn/{env}/{name}@{rN}/``
    and ``@{id}/`` straight to its Service, as the function's own route does."""
    env, name = kept.deployment.env, kept.deployment.name
    unit = f"{name}@{kept.id}"
    route = render_http_route(env, name, timeout_sec, config)
    rule = route["spec"]["rules"][0]
    rules = []
    for ref in (kept.label, kept.id):
        prefix = f"/fn/{env}/{name}@{ref}"
        one = copy.deepcopy(rule)
        one["matches"][0]["path"]["value"] = prefix
        for step in one.get("filters") or []:
            for header in (step.get("requestHeaderModifier") or {}).get("set") or []:
                if header["name"] == "X-Forwarded-Prefix":
                    header["value"] = prefix
        one["backendRefs"][0]["name"] = object_name(unit)
        rules.append(one)
    route["spec"]["rules"] = rules
    _relabel(route, unit, {REVISION_OF: name, REVISION_ID: kept.id})
    route["metadata"]["annotations"][SPEC_HASH] = spec_hash(route)
    return route


def split_route(route: dict[str, Any], unit: str, percent: int) -> dict[str, Any]:
    """The function's HTTPRoute (as rendered, to its Service) sharing its calls: ``percent``
    to the Service of ``unit`` (a rollout's candidate), the rest as before. Weights of 0
    are written too: the route says plainly where nothing goes."""
    split = copy.deepcopy(route)
    for rule in split["spec"]["rules"]:
        own = rule["backendRefs"][0]
        rule["backendRefs"] = [
            {**own, "weight": 100 - percent},
            {**own, "name": object_name(unit), "weight": percent},
        ]
    split["metadata"]["annotations"][SPEC_HASH] = spec_hash(split)
    return split
