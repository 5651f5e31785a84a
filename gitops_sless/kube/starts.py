"""Replicas started for waiting calls, followed until one serves or a pod says why none will.

A call to an autoscaled function at zero replicas waits in the proxy while a
wake raises its Deployment (``KubeBackend.scale``); the watch reports the
replica ready, and its route gets an upstream at once. A pod that cannot
start (a crash loop, an image that cannot be pulled, a missing Secret)
changes no Deployment, so while a start is under way the function's pods
are LISTed, at most every ``poll_sec``. What they say becomes the route's
``failed``, with ``retry_at`` ``backoff_sec`` ahead (the kubelet's own first
crash-loop back-off): calls waiting for the start answer 502 naming it,
rather than time out, and no call makes the proxy wake it again meanwhile.
Following ends when a replica serves, when the Deployment goes back to zero
or away, or after ``limit_sec`` (the Deployment's progress deadline).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..errors import SlessError
from .client import KubeClient
from .status import available_replicas, start_problem
from .units import object_name, pod_selector
from .view import View

__all__ = ["Starts"]

log = logging.getLogger(__name__)

Key = tuple[str, str]


class Starts:
    """Why the last start of each function failed, while that holds (module doc)."""

    poll_sec = 1.0
    backoff_sec = 10.0

    def __init__(
        self,
        client: KubeClient,
        publish: Callable[[View, str], None],
        replicas: Callable[[View, str], int],
        limit_sec: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``publish(view, name)``: the function's route made again (its failure changed);
        ``replicas(view, name)``: how many its Deployment asks for (a write the watch has
        not brought back yet included)."""
        self.client = client
        self.publish = publish
        self.replicas = replicas
        self.limit_sec = limit_sec
        self.clock = clock
        self._failures: dict[Key, tuple[str, float]] = {}  # -> (why, retry at: clock())
        self._following: set[Key] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def failure(self, env: str, name: str) -> tuple[str | None, float]:
        """(why the last start failed, until when calls are refused) or (None, 0.0)."""
        found = self._failures.get((env, name))
        return found if found is not None else (None, 0.0)

    def forget(self, env: str, name: str) -> None:
        """A new spec is applied: its start is a new try."""
        with self._lock:
            self._failures.pop((env, name), None)

    def close(self) -> None:
        self._stop.set()

    def follow(self, view: View, name: str) -> None:
        """Follow the start of ``name``'s replicas, unless that is done already."""
        key = (view.env, name)
        with self._lock:
            if key in self._following or self._stop.is_set():
                return
            self._following.add(key)
        thread = threading.Thread(
            target=self._follow, args=(view, name), name=f"sless-start-{name}", daemon=True
        )
        thread.start()

    def _follow(self, view: View, name: str) -> None:
        key = (view.env, name)
        deployments = view.informer("Deployment")
        deadline = self.clock() + self.limit_sec
        next_list = 0.0
        try:
            while not self._stop.is_set() and self.clock() < deadline:
                seen = deployments.version()
                deployment = view.get("Deployment", object_name(name))
                if deployment is None or not self.replicas(view, name):
                    return  # scaled back to zero, or gone: nothing starts
                if available_replicas(deployment):
                    self._set(view, name, None)
                    return
                now = self.clock()
                if now >= next_list:
                    next_list = now + self.poll_sec
                    self._look(view, name)
                deployments.wait_change(seen, max(0.0, next_list - self.clock()))
        except SlessError as exc:  # the next wake follows it again
            log.info("following the start of %s/%s: %s", view.env, name, exc)
        finally:
            with self._lock:
                self._following.discard(key)

    def _look(self, view: View, name: str) -> None:
        selector = pod_selector(view.env, name)
        problem = start_problem(self.client.list("Pod", view.namespace, selector))
        why, until = self.failure(view.env, name)
        if problem is None or (problem == why and self.clock() < until):
            return
        self._set(view, name, problem)

    def _set(self, view: View, name: str, problem: str | None) -> None:
        key = (view.env, name)
        with self._lock:
            if problem is None:
                if self._failures.pop(key, None) is None:
                    return
            else:
                self._failures[key] = (problem, self.clock() + self.backoff_sec)
        if problem is not None:
            log.warning("%s/%s: a replica started for a call cannot run: %s", *key, problem)
        self.publish(view, name)
