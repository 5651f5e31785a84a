"""What a function's replicas report of their load: the busy seconds of its runtime servers.

Every runtime server answers ``GET /health`` with
``{"status":"ok","inflight":N,"requests":T,"busySeconds":S}``, S the integral
of its calls in flight since its process started. The autoscaler wants the
function's call-seconds so far (their change over a window is its average
concurrency) as the replicas count them, not as this proxy does: on
Kubernetes calls may come through a Gateway, and each reconciler replica sees
only its own.

:class:`RuntimeLoad` reads each ready pod of a function: in the cluster at its
address (``http://<pod IP>:8080/health``: the environment's NetworkPolicies
admit the reconciler's pods, and the API server is spared a call per pod and
tick), from outside through the API server's pod proxy
(``pods/{pod}:8080/proxy/health``, with the client's credentials), all at
once, each with a short timeout, and adds up what each *process* served: per
pod uid and container restart count, its last reading is kept and only
increases are added; a process seen for the first time adds its whole reading.
So the total never goes down when a pod restarts, is deleted or is replaced.
The pods come from one LIST of the environment's pods, reused for ``list_sec``
by every function of the namespace; a function read less than ``read_sec`` ago
answers what it answered then.
"""

from __future__ import annotations

import copy
import http.client
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import SlessError
from .client import Forbidden, KubeClient
from .kinds import KINDS
from .renderer import CONTAINER_PORT, ENV_LABEL, FUNCTION_LABEL, MANAGED_BY

__all__ = ["PodLoad", "RuntimeLoad"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PodLoad:
    """A pod of a function, as far as its load goes."""

    name: str
    uid: str
    function: str
    restarts: int  # its containers' restarts: a new count is a new process
    ready: bool
    ip: str = ""  # status.podIP


@dataclass
class _Function:
    """The busy seconds of one function's processes, as read so far."""

    total: float = 0.0
    last: dict[str, tuple[int, float]] = field(default_factory=dict)  # uid -> (restarts, S)
    read_at: float | None = None
    answer: float | None = None

    def add(self, pods: list[PodLoad], readings: list[float | None]) -> float | None:
        """The total with these readings (None: none answered)."""
        answered = False
        for pod, value in zip(pods, readings, strict=True):
            if value is None:
                continue
            answered = True
            seen = self.last.get(pod.uid)
            if seen is None or seen[0] != pod.restarts:
                self.total += value  # a new process: all it served is new
            elif value > seen[1]:
                self.total += value - seen[1]
            # lower with the same count: a restart the pod's status does not show yet; its
            # whole reading is added once the new count shows
            self.last[pod.uid] = (pod.restarts, value)
        return self.total if answered else None

    def keep(self, listed: set[str]) -> None:
        """Forget the pods that are gone (a pod not ready now keeps its last reading)."""
        for uid in set(self.last) - listed:
            del self.last[uid]


class RuntimeLoad:
    """The busy seconds of functions' runtime servers, summed over their pods (module doc)."""

    read_sec = 0.5  # a function is read at most this often
    list_sec = 0.5  # an environment's pods are LISTed at most this often
    timeout_sec = 1.0  # one pod's /health
    workers = 8  # pods read at once
    port = CONTAINER_PORT  # where the runtime listens in its pod

    def __init__(self, client: KubeClient, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        # the same connections and credentials, with a short timeout and no retry
        self.quick = copy.copy(client)
        self.quick.timeout_sec = self.timeout_sec
        self.clock = clock
        self._pods: dict[str, tuple[float, list[PodLoad]]] = {}  # namespace -> (read at, pods)
        self._functions: dict[tuple[str, str], _Function] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._refused = False

    def busy(self, namespace: str, env: str, name: str) -> float | None:
        """Call-seconds the replicas of ``name`` served so far, never going down; None when
        none can be read (no ready pod, or none answered)."""
        now = self.clock()
        with self._lock:
            function = self._functions.setdefault((namespace, name), _Function())
        if function.read_at is not None and now - function.read_at < self.read_sec:
            return function.answer
        listed = self._listed(namespace, env, now)
        if listed is None:
            return None
        pods = [p for p in listed if p.function == name and p.ready]
        readings = self._read(namespace, pods)
        function.keep({p.uid for p in listed if p.function == name})
        function.read_at = now
        function.answer = function.add(pods, readings)
        return function.answer

    def forget(self, namespace: str, name: str) -> None:
        """A function removed: what was read of it goes."""
        with self._lock:
            self._functions.pop((namespace, name), None)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _listed(self, namespace: str, env: str, now: float) -> list[PodLoad] | None:
        """The environment's pods, LISTed at most every ``list_sec``; None: unreadable."""
        with self._lock:
            cached = self._pods.get(namespace)
        if cached is not None and now - cached[0] < self.list_sec:
            return cached[1]
        selector = {MANAGED_BY: "gitops-sless", ENV_LABEL: env}
        try:
            pods = [_pod(p) for p in self.client.list("Pod", namespace, selector)]
        except SlessError as exc:
            log.info("the pods of %s cannot be listed for their load: %s", namespace, exc)
            return None
        with self._lock:
            self._pods[namespace] = (now, pods)
        return pods

    def _read(self, namespace: str, pods: list[PodLoad]) -> list[float | None]:
        if len(pods) <= 1:
            return [self._health(namespace, pod) for pod in pods]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="sless-load")
            pool = self._pool
        return list(pool.map(lambda pod: self._health(namespace, pod), pods))

    def _health(self, namespace: str, pod: PodLoad) -> float | None:
        """The busy seconds one pod's runtime reports; None: no answer, or none it holds."""
        try:
            if self.client.in_cluster:  # no address yet: not ready to be read
                return self._direct(pod.ip) if pod.ip else None
            path = f"{KINDS['Pod'].path(namespace, pod.name)}:{self.port}/proxy/health"
            answer = json.loads(self.quick.request("proxy", "Pod", "GET", path, attempts=1))
            return float(answer["busySeconds"])
        except Forbidden as exc:
            if not self._refused:
                self._refused = True
                log.warning("the runtimes' load cannot be read (pods/proxy): %s", exc)
            return None
        except (SlessError, OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("%s/%s: no load read: %s", namespace, pod.name, exc)
            return None

    def _direct(self, ip: str) -> float:
        conn = http.client.HTTPConnection(ip, self.port, timeout=self.timeout_sec)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise ValueError(f"/health answered {response.status}")
            return float(json.loads(body)["busySeconds"])
        finally:
            conn.close()


def _pod(obj: dict[str, Any]) -> PodLoad:
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    ready = status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )
    restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or ())
    function = str((meta.get("labels") or {}).get(FUNCTION_LABEL) or "")
    ip = str(status.get("podIP") or "")
    return PodLoad(str(meta.get("name")), str(meta.get("uid")), function, restarts, ready, ip)
