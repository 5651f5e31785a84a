"""The routing table of the invoke proxy: which functions exist and where they answer.

The backend writes it (a function is added when deployed, its upstreams change
as replicas become healthy, it is removed the moment its manifest is gone);
the proxy only reads it. Lookups never touch the disk or take a lock: the
table is an immutable dict swapped whole on every change.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

__all__ = ["Declared", "Route", "RouteTable"]

Upstream = tuple[str, int]


@dataclass(frozen=True)
class Declared:
    """A function the repository declares, as the status store sees it."""

    phase: str  # Pending, Building, Ready, Failed, Invalid, Disabled
    message: str | None = None
    http: bool = True  # False: declared without an http trigger, so never callable


@dataclass(frozen=True)
class Route:
    """One function of one environment. No upstreams means known but not ready (503)."""

    env: str
    name: str
    timeout_sec: float
    upstreams: tuple[Upstream, ...] = ()
    # why the last replica that left the route ended (e.g. "OOMKilled: ..."), so a call it
    # was answering can say why it got a 502
    last_exit: str | None = None
    _turn: itertools.count = field(default_factory=itertools.count, compare=False, repr=False)

    def pick(self) -> Upstream | None:
        """The next upstream, round robin; None when nothing is ready."""
        if not self.upstreams:
            return None
        return self.upstreams[next(self._turn) % len(self.upstreams)]


class RouteTable:
    """Routes (where a function answers) and declarations (what the repository names).

    A name with a route is served; a declared name without a serving route
    answers 503 with its phase and message; any other name is 404.
    """

    def __init__(self) -> None:
        self._routes: dict[tuple[str, str], Route] = {}
        self._declared: dict[str, dict[str, Declared]] = {}
        self._write = threading.Lock()

    def declared(self, env: str, name: str) -> Declared | None:
        return self._declared.get(env, {}).get(name)

    def declare(self, env: str, functions: dict[str, Declared]) -> None:
        """Replace what ``env`` declares, whole (an empty mapping forgets the environment)."""
        with self._write:
            declared = {**self._declared, env: dict(functions)}
            if not functions:
                declared.pop(env)
            self._declared = declared

    def get(self, env: str, name: str) -> Route | None:
        return self._routes.get((env, name))

    def set(self, route: Route) -> None:
        with self._write:
            self._routes = {**self._routes, (route.env, route.name): route}

    def remove(self, env: str, name: str) -> None:
        with self._write:
            routes = dict(self._routes)
            routes.pop((env, name), None)
            self._routes = routes

    def names(self, env: str) -> list[str]:
        return sorted(name for e, name in self._routes if e == env)
