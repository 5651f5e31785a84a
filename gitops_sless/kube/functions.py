"""``Function`` custom resources: the cluster's read-only view of the repository.

The leader writes one ``Function`` (``functions.gitops-sless.dev/v1alpha1``)
per function of every environment, in the environment's namespace: ``spec``
is the manifest's function after defaults (a secret stays a ``{secret, key}``
reference), ``status`` is what the status store says, with ``Ready`` and
``Built`` conditions as the Kubernetes API conventions describe them. So
``kubectl get fn -A`` lists every function and ``kubectl wait
--for=condition=Ready fn/NAME`` works. The route's policy (autoscaling, call limits)
rides along as the Deployment's ``gitops-sless.dev/route`` annotation does, so a
replica that does not lead can hold a call to an ``Idle`` function and wake it.
Both parts are written only when they differ from what the cluster holds, so a
pass with no change writes nothing; a hand edit differs, and is put back.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ..manifests.model import AsyncPolicy, Function, JobRef, SecretRef
from ..timestamps import rfc3339
from .client import KubeClient
from .policy import ROUTE_ANNOTATION, route_policy
from .renderer import ENV_LABEL, FUNCTION_LABEL, MANAGED_BY, SPEC_HASH, RenderConfig
from .view import View, annotation, drifted

__all__ = ["API_VERSION", "MANIFEST_LABEL", "FunctionWriter"]

API_VERSION = "gitops-sless.dev/v1alpha1"
MANIFEST_LABEL = "gitops-sless.dev/manifest"
MANIFEST_ANNOTATION = "gitops-sless.dev/manifest-path"
MAX_RUNS = 20
MAX_RESULT = 1024
READY_PHASES = ("Ready", "Idle")  # an Idle function takes calls: the first starts a replica


def _label_value(path: str) -> str:
    """A manifest path as a label value (no ``/``, at most 63 characters)."""
    value = path.replace("/", ".").strip("._-")
    if len(value) > 63:
        value = value[:50].rstrip("._-") + "-" + hashlib.sha256(path.encode()).hexdigest()[:12]
    return value


def async_spec(policy: AsyncPolicy) -> dict[str, Any]:
    return policy.to_json()


def async_policy(spec: dict[str, Any]) -> AsyncPolicy:
    """A Function resource's async policy (the defaults where it has none: written by an
    older reconciler)."""
    return AsyncPolicy.from_json(spec.get("async") or {})


def function_spec(fn: Function, env: str) -> dict[str, Any]:
    env_values: dict[str, dict[str, str]] = {}
    for name, value in sorted(fn.env_for(env).items()):
        if isinstance(value, SecretRef):
            env_values[name] = {"secret": value.secret, "key": value.key}
        elif isinstance(value, JobRef):
            env_values[name] = {"job": value.job}
        else:
            env_values[name] = {"value": value}
    return {
        "runtime": fn.runtime,
        "entrypoint": fn.entrypoint,
        "memoryMB": fn.memory_mb,
        "timeoutSec": fn.timeout_sec,
        "replicas": fn.replicas,
        "enabled": fn.enabled,
        "http": bool(fn.http),
        "crons": [{"schedule": c.schedule, "event": dict(c.event)} for c in fn.crons],
        "env": env_values,
        "jobs": [{"name": j.name, "runId": j.run_id, "event": dict(j.event)} for j in fn.jobs],
        "async": async_spec(fn.async_policy),
        "subjects": list(fn.subjects),
        "buildTag": fn.build_tag,
        "manifest": fn.manifest,
        "folder": fn.folder,
        "environment": env,
    }


def _digest(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


class FunctionWriter:
    """Writes the ``Function`` resources of one environment from the status store's rows."""

    def __init__(self, client: KubeClient, config: RenderConfig) -> None:
        self.client = client
        self.config = config

    def write(
        self,
        view: View,
        records: Iterable[Mapping[str, Any]],
        functions: Mapping[str, Function],
        runs: Iterable[Mapping[str, Any]],
        images: Mapping[str, str],
        shares: Mapping[str, tuple[str, int]] | None = None,
    ) -> int:
        """Bring every Function of ``view.env`` in step; returns the writes made.

        ``images``: build tag -> the pinned image this environment runs for it;
        ``shares``: function -> (revision, percent) a rollout's candidate takes now."""
        if not view.namespace_exists:
            return 0
        writes = 0
        wanted: set[str] = set()
        runs_by_function: dict[str, list[Mapping[str, Any]]] = {}
        for run in runs:
            runs_by_function.setdefault(run["function"], []).append(run)
        for record in records:
            name = record["name"]
            wanted.add(name)
            live = view.get("Function", name)
            fn = functions.get(name)
            if fn is not None or live is None:
                obj = self._object(view, record, fn)
                if live is None or _changed(live, obj):
                    live = self.client.apply(obj)
                    view.put(live)
                    writes += 1
            status = self._status(record, fn, runs_by_function.get(name, []), images, live)
            share = (shares or {}).get(name)
            if share is not None:
                status["traffic"] = _traffic(record.get("serving_revision"), share)
            if (live.get("status") or {}) != status:
                live = self.client.apply_status(_status_patch(live, status))
                view.put(live)
                writes += 1
        for live in view.all("Function"):
            if live["metadata"]["name"] not in wanted:
                self.client.delete("Function", view.namespace, live["metadata"]["name"])
                view.drop("Function", live["metadata"]["name"])
                writes += 1
        return writes

    def _object(self, view: View, record: Mapping[str, Any], fn: Function | None) -> dict[str, Any]:
        name, manifest = record["name"], record.get("manifest") or ""
        spec = (
            function_spec(fn, view.env)
            if fn is not None
            else {"manifest": manifest, "environment": view.env}
        )
        annotations = {SPEC_HASH: _digest(spec), MANIFEST_ANNOTATION: manifest}
        policy = route_policy(fn, view.env).encode() if fn is not None and fn.http else None
        if policy:  # in the hash too: a new policy is written (none: the hash stays as it was)
            annotations.update({ROUTE_ANNOTATION: policy, SPEC_HASH: _digest([spec, policy])})
        return {
            "apiVersion": API_VERSION,
            "kind": "Function",
            "metadata": {
                "name": name,
                "namespace": view.namespace,
                "labels": {
                    MANAGED_BY: "gitops-sless",
                    ENV_LABEL: view.env,
                    FUNCTION_LABEL: name,
                    MANIFEST_LABEL: _label_value(manifest),
                },
                "annotations": annotations,
            },
            "spec": spec,
        }

    def _status(
        self,
        record: Mapping[str, Any],
        fn: Function | None,
        runs: list[Mapping[str, Any]],
        images: Mapping[str, str],
        live: Mapping[str, Any],
    ) -> dict[str, Any]:
        generation = int(live.get("metadata", {}).get("generation") or 1)
        tag = record.get("build_tag")
        wanted_tag = fn.build_tag if fn is not None else tag
        phase = record["phase"]
        message = record.get("message") or ""
        status: dict[str, Any] = {
            "phase": phase,
            "observedGeneration": generation,
            "updated": rfc3339(record.get("updated")),
            "restarts": int(record.get("restarts") or 0),
        }
        optional = {
            "message": record.get("message"),
            "buildTag": tag,
            "image": images.get(tag) if tag else None,
            "revision": record.get("revision"),
            "url": record.get("url"),
            "lastExit": record.get("last_exit"),
            "servingRevision": record.get("serving_revision"),
            "pinned": record.get("pinned"),
        }
        status.update({k: v for k, v in optional.items() if v})
        jobs = [
            {
                "name": run["name"],
                "runId": int(run["run_id"]),
                "phase": run["phase"],
                **({"result": _clip(run["result"])} if run.get("result") else {}),
                **({"finished": rfc3339(run["finished"])} if run.get("finished") else {}),
            }
            for run in sorted(runs, key=lambda r: (r["name"], -int(r["run_id"])))[:MAX_RUNS]
        ]
        if jobs:
            status["jobs"] = jobs
        ready = phase in READY_PHASES
        is_built = bool(wanted_tag) and wanted_tag in images
        previous = {c.get("type"): c for c in (live.get("status") or {}).get("conditions") or []}
        status["conditions"] = [
            _condition(previous, "Ready", ready, phase, message or f"the function is {phase}"),
            _condition(
                previous,
                "Built",
                is_built,
                "ImageBuilt" if is_built else ("Building" if phase == "Building" else "NotBuilt"),
                f"image {images[wanted_tag]}"
                if is_built and wanted_tag
                else (message if phase == "Failed" else "no image for the current code yet"),
            ),
        ]
        for condition in status["conditions"]:
            condition["observedGeneration"] = generation
        return status


def _condition(
    previous: Mapping[str, Mapping[str, Any]], kind: str, true: bool, reason: str, message: str
) -> dict[str, Any]:
    value = "True" if true else "False"
    before = previous.get(kind) or {}
    # the transition time changes only when the status does (API conventions)
    changed = before.get("status") != value
    stamp = rfc3339(time.time()) if changed else before.get("lastTransitionTime")
    return {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": (message or reason)[:1024],
        "lastTransitionTime": stamp or rfc3339(time.time()),
    }


def _clip(text: str) -> str:
    return text if len(text) <= MAX_RESULT else text[: MAX_RESULT - 1] + "…"


def _changed(live: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    return (
        annotation(dict(live), SPEC_HASH) != wanted["metadata"]["annotations"][SPEC_HASH]
        or (live.get("metadata") or {}).get("labels") != wanted["metadata"]["labels"]
        or drifted(dict(live))
    )


def _traffic(serving: str | None, share: tuple[str, int]) -> list[dict[str, Any]]:
    """How the function's calls are split: the revision serving, and a candidate's share
    (or a revision switched to, taking every call while the Deployment rolls to it)."""
    revision, percent = share
    split = {serving or "-": 100 - percent}
    split[revision] = split.get(revision, 0) + percent
    return [{"revision": r, "percent": p} for r, p in split.items() if p > 0]


def _status_patch(live: Mapping[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    meta = live["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": "Function",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "status": status,
    }
