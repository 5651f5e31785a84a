"""Server-side apply of what the renderer produced, and label-scoped deletes.

An object whose live ``gitops-sless.dev/spec-hash`` matches the rendered one
(and that no other field manager has changed) is not written: a pass with no
change makes zero writes. Objects go in dependency order (the namespace
before what lives in it). Deletes touch only objects labelled
``app.kubernetes.io/managed-by: gitops-sless`` and this environment.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from .client import KubeClient
from .renderer import ENV_LABEL, MANAGED_BY, SPEC_HASH, RenderConfig, environment_objects
from .view import View, annotation, drifted, label

__all__ = ["ORDER", "Applier"]

log = logging.getLogger(__name__)

ORDER = {
    kind: rank
    for rank, kind in enumerate(
        (
            "Namespace",
            "NetworkPolicy",
            "ServiceAccount",
            "Secret",
            "ConfigMap",
            "Deployment",
            "Service",
            "HTTPRoute",  # after its Service: a route to nothing would answer 500
            "CronJob",
            "Job",
        )
    )
}


class Applier:
    def __init__(self, client: KubeClient, config: RenderConfig) -> None:
        self.client = client
        self.config = config
        self._ready: set[str] = set()  # environments ensured since the last read
        self._lock = threading.Lock()

    def forget(self, env: str) -> None:
        """The view of ``env`` was read again: check its namespace objects again."""
        with self._lock:
            self._ready.discard(env)

    def apply(self, view: View, objects: Iterable[dict[str, Any]]) -> int:
        """Write the objects whose live spec differs; returns how many were written."""
        written = 0
        for obj in sorted(objects, key=lambda o: ORDER[o["kind"]]):
            live = view.get(obj["kind"], obj["metadata"]["name"])
            if live is not None and _same(live, obj):
                continue
            view.put(self.client.apply(obj))
            written += 1
        return written

    def ensure_environment(self, view: View) -> None:
        """The namespace, its network policy and the pull Secret, once per read of the view.

        Held under one lock: the workers applying functions of a new environment in
        parallel must not each write its namespace.
        """
        with self._lock:
            if view.env in self._ready:
                return
            objects = environment_objects(view.env, self.config)
            if not view.namespace_exists:
                view.put(self.client.apply(objects[0]))
                view.namespace_exists = True
            self.apply(view, objects[1:])
            if self.config.image_pull_secret:
                self._copy_pull_secret(view)
            self._ready.add(view.env)

    def _copy_pull_secret(self, view: View) -> None:
        source = self.client.get(
            "Secret", self.config.controller_namespace, self.config.image_pull_secret or ""
        )
        if source is None:
            log.warning(
                "pull Secret %s/%s not found: images are pulled without credentials",
                self.config.controller_namespace,
                self.config.image_pull_secret,
            )
            return
        copy = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": self.config.image_pull_secret,
                "namespace": view.namespace,
                "labels": {MANAGED_BY: "gitops-sless", ENV_LABEL: view.env},
            },
            "type": source.get("type") or "kubernetes.io/dockerconfigjson",
            "data": source.get("data") or {},
        }
        live = self.client.get("Secret", view.namespace, self.config.image_pull_secret or "")
        # compared by content, never by a hash of it: a hash of a secret is not published
        if live is None or live.get("data") != copy["data"] or live.get("type") != copy["type"]:
            self.client.apply(copy)

    def delete(self, view: View, objects: Iterable[dict[str, Any]]) -> int:
        """Delete managed objects of this environment only; returns how many."""
        deleted = 0
        for obj in sorted(objects, key=lambda o: -ORDER.get(o["kind"], 0)):
            if label(obj, MANAGED_BY) != "gitops-sless" or label(obj, ENV_LABEL) != view.env:
                continue  # never anything this reconciler did not create for this env
            name = obj["metadata"]["name"]
            self.client.delete(obj["kind"], view.namespace, name, "Background")
            view.drop(obj["kind"], name)
            deleted += 1
        return deleted


def _same(live: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return annotation(live, SPEC_HASH) == annotation(wanted, SPEC_HASH) and not drifted(live)
