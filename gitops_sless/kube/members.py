"""Which replicas of the reconciler are up: a Lease of its own for each, renewed.

As kube-apiserver's identity leases: every replica creates the Lease
``<instance>-member-<holder>`` (label ``gitops-sless.dev/member``) in the
reconciler's namespace and renews it every ``renew_sec``; it lists the
others' and counts those it has seen renewed within ``lease_sec`` (on its own
clock, as the leader election measures, so clocks need not agree), itself
always. A replica that stops deletes its own; one killed outright stops
counting once its lease has not moved for ``lease_sec``, and the next replica
to notice deletes it.

What the count is for: each replica's proxy enforces ``1/count`` of every
``rateLimit``, so together they admit what the manifest says (Envoy's local
rate limit, shared out). The leases also carry what the replicas tell each other
(``annotations`` / ``on_annotations``): the dashboard sessions signed out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from ..errors import SlessError
from ..metrics import METRICS
from .client import KubeClient

__all__ = ["MEMBER_LABEL", "Members"]

log = logging.getLogger(__name__)

MEMBER_LABEL = "gitops-sless.dev/member"


class Members:
    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        holder: str,
        *,
        instance: str = "gitops-sless",
        renew_sec: float = 5.0,
        lease_sec: float = 15.0,
        on_count: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.holder = holder
        self.name = _name(f"{instance}-member-{holder}")
        self.instance = instance
        self.renew_sec = renew_sec
        self.lease_sec = lease_sec
        self.on_count = on_count
        self.clock = clock
        self._seen: dict[str, tuple[str | None, float]] = {}  # name -> (renewTime, seen at)
        self._count = 1
        self._stop = threading.Event()
        self._wake = threading.Event()  # a round now, not at the next renew_sec
        self._thread: threading.Thread | None = None
        # what this replica tells the others, in its lease's annotations, and what it is
        # told: each other live replica's annotations, every round
        self.annotations: Callable[[], dict[str, str]] | None = None
        self.on_annotations: Callable[[dict[str, str]], None] | None = None

    def count(self) -> int:
        """Replicas up, this one included (1 until the first round)."""
        return self._count

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sless-members", daemon=True)
        self._thread.start()

    def nudge(self) -> None:
        """Renew (and so tell the others) now rather than at the next round."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        with contextlib.suppress(SlessError):
            self.client.delete("Lease", self.namespace, self.name)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.round()
            except SlessError as exc:
                log.debug("member lease %s: %s", self.name, exc)
            self._wake.wait(self.renew_sec)
            self._wake.clear()

    def round(self) -> int:
        """Renew this replica's lease, count the live ones; the count."""
        self._renew()
        now = self.clock()
        live = 0
        selector = f"{MEMBER_LABEL}={self.instance}"
        for lease in self.client.list("Lease", self.namespace, selector):
            name = lease["metadata"]["name"]
            renewed = (lease.get("spec") or {}).get("renewTime")
            seen = self._seen.get(name)
            if seen is None or seen[0] != renewed:
                seen = self._seen[name] = (renewed, now)
            if name == self.name or now - seen[1] <= self.lease_sec:
                live += 1
                told = (lease.get("metadata") or {}).get("annotations") or {}
                if name != self.name and told and self.on_annotations is not None:
                    self.on_annotations(dict(told))
            elif now - seen[1] > 2 * self.lease_sec:  # long gone: tidy up after it
                with contextlib.suppress(SlessError):
                    self.client.delete("Lease", self.namespace, name)
        count = max(1, live)
        if count != self._count:
            log.info("%d replicas of the reconciler are up", count)
        self._count = count
        METRICS.reconciler_replicas.set(count)
        if self.on_count is not None:
            self.on_count(count)
        return count

    def _renew(self) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        live = self.client.get("Lease", self.namespace, self.name)
        body: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {MEMBER_LABEL: self.instance},
                "annotations": self.annotations() if self.annotations is not None else {},
            },
            "spec": {
                "holderIdentity": self.holder,
                "leaseDurationSeconds": int(self.lease_sec),
                "renewTime": now,
            },
        }
        if live is None:
            self.client.create(body, guarded=False)
        else:
            body["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
            self.client.update(body, attempts=1)


def _name(text: str) -> str:
    """A DNS-1123 subdomain of at most 253 characters."""
    cleaned = "".join(c if c.isalnum() or c in "-." else "-" for c in text.lower())
    return cleaned[:253].strip("-.") or "member"
