"""Leader election with a ``coordination.k8s.io/v1`` Lease, as client-go does it.

Replicas race for the Lease ``gitops-sless`` in the reconciler's namespace.
The holder renews it every ``renew_sec``; the others look every
``retry_sec`` and take it once it has not changed for ``lease_sec`` (time
measured on their own clock from when they last saw it change, so clocks
need not agree). Writes are optimistic (``resourceVersion``): of two
replicas racing, one gets 409 and stays a follower.

The holder may write only until its renew deadline (``renew_deadline_sec``
after its last successful renewal, shorter than the lease): a replica that
cannot renew stops writing before another can take over.

The holder writes where it answers HTTP (``address``) into the annotation
``gitops-sless.dev/leader-url``: a replica that does not lead hands the
webhooks it receives to that address (see :meth:`LeaderElector.leader_url`).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from .. import logs
from ..errors import SlessError
from .client import AlreadyExists, KubeClient, KubeUnavailable
from .members import Members

__all__ = ["LeaderElector", "identity"]

log = logging.getLogger(__name__)

LEASE_NAME = "gitops-sless"
LEADER_URL = "gitops-sless.dev/leader-url"


def identity() -> str:
    """Unique per process: the pod's name (or the host's) and a random suffix."""
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}-{secrets.token_hex(3)}"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        *,
        name: str = LEASE_NAME,
        holder: str | None = None,
        lease_sec: float = 15.0,
        renew_sec: float = 5.0,
        renew_deadline_sec: float = 10.0,
        retry_sec: float = 2.0,
        on_change: Callable[[bool], None] | None = None,
        address: str | None = None,
        on_members: Callable[[int], None] | None = None,
    ) -> None:
        """``address``: this replica's base URL as the others reach it (None: not reachable);
        ``on_members(n)``: how many replicas are up, after every round of theirs (members)."""
        self.address = address
        self._leader_url: str | None = None  # the holder's address, while another holds it
        self.client = client
        self.namespace = namespace
        self.name = name
        self.holder = holder or identity()
        self.lease_sec = lease_sec
        self.renew_sec = renew_sec
        self.renew_deadline_sec = renew_deadline_sec
        self.retry_sec = retry_sec
        self._on_change = on_change
        self._deadline = 0.0  # monotonic: writes allowed until then
        self._observed: tuple[str | None, str | None] = (None, None)  # (holder, renewTime)
        self._observed_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._leading = False
        self.members = Members(
            client,
            namespace,
            self.holder,
            instance=name,
            renew_sec=renew_sec,
            lease_sec=lease_sec,
            on_count=on_members,
        )

    def is_leader(self) -> bool:
        return time.monotonic() < self._deadline

    def leader_url(self) -> str | None:
        """Where the replica that leads answers HTTP, as its lease last said; None while
        this replica leads, no one does, or the holder wrote no address."""
        return None if self.is_leader() else self._leader_url

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sless-lease", daemon=True)
        self._thread.start()
        self.members.start()

    def stop(self) -> None:
        """Stop renewing; the lease is released (an empty holder) if it is ours."""
        self._stop.set()
        self.members.stop()
        if self._thread is not None:
            self._thread.join(5)
        if self.is_leader():
            self._deadline = 0.0
            self._release()
        self._changed(False)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.try_acquire_or_renew()
            except SlessError as exc:
                log.debug("lease %s: %s", self.name, exc)
            self._changed(self.is_leader())
            self._stop.wait(self.renew_sec if self.is_leader() else self.retry_sec)

    def _changed(self, leading: bool) -> None:
        if leading == self._leading:
            return
        self._leading = leading
        what = "acquired" if leading else "lost"
        logs.event(log, f"lease.{what}", f"{self.name} {what} by {self.holder}")
        if self._on_change is not None:
            self._on_change(leading)

    def try_acquire_or_renew(self) -> bool:
        """One round; True when this replica holds the lease afterwards."""
        started = time.monotonic()
        lease = self.client.get("Lease", self.namespace, self.name)
        if lease is None:
            try:
                self._write(self._lease(None, transitions=0), create=True)
            except AlreadyExists:
                return False
            self._deadline = started + self.renew_deadline_sec
            return True
        spec = lease.get("spec") or {}
        holder, renewed = spec.get("holderIdentity"), spec.get("renewTime")
        if (holder, renewed) != self._observed:
            self._observed, self._observed_at = (holder, renewed), started
        duration = float(spec.get("leaseDurationSeconds") or self.lease_sec)
        expired = not holder or started - self._observed_at > duration
        annotations = (lease.get("metadata") or {}).get("annotations") or {}
        self._seen_leader(holder if not expired else None, annotations.get(LEADER_URL))
        if holder != self.holder and not expired:
            self._deadline = 0.0
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.holder)
        acquired = spec.get("acquireTime") if holder == self.holder else None
        body = self._lease(lease, transitions=transitions, acquired=acquired)
        try:
            self._write(body)
        except KubeUnavailable:  # 409: someone else wrote it first
            self._deadline = 0.0
            return False
        self._deadline = started + self.renew_deadline_sec
        return True

    def _seen_leader(self, holder: str | None, url: str | None) -> None:
        url = url if holder and holder != self.holder else None
        if url != self._leader_url and url:
            logs.event(log, "lease.leader", f"{self.name} held by {holder}: webhooks go to {url}")
        self._leader_url = url

    def _lease(
        self, live: dict[str, Any] | None, transitions: int, acquired: str | None = None
    ) -> dict[str, Any]:
        now = _now()
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if live is not None:
            metadata["resourceVersion"] = live["metadata"]["resourceVersion"]
        if self.address:
            metadata["annotations"] = {LEADER_URL: self.address}
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": self.holder,
                "leaseDurationSeconds": int(self.lease_sec),
                "acquireTime": acquired or now,
                "renewTime": now,
                "leaseTransitions": transitions,
            },
        }

    def _write(self, body: dict[str, Any], create: bool = False) -> None:
        # the lease itself is written whoever leads: the guard is for everything else
        if create:
            self.client.create(body, guarded=False)
        else:
            self.client.update(body, attempts=1)

    def _release(self) -> None:
        try:
            lease = self.client.get("Lease", self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.holder:
                body = self._lease(lease, int(lease["spec"].get("leaseTransitions") or 0))
                body["spec"]["holderIdentity"] = ""
                self.client.update(body, attempts=1)
        except SlessError as exc:
            log.debug("lease %s: release failed: %s", self.name, exc)
