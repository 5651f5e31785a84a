"""The routing table of the invoke proxy: which functions exist and where they answer.

The backend writes it (a function is added when deployed, its upstreams change
as replicas become healthy, it is removed the moment its manifest is gone);
the proxy only reads it. Lookups never touch the disk or take a lock: the
table is an immutable dict swapped whole on every change.

A route either reaches its upstreams directly, over plain HTTP, or through a
:class:`Gateway`: another HTTP server that forwards to them, such as the
Kubernetes API server's service proxy for a backend outside the cluster.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from ssl import SSLContext

from ..manifests.model import DEFAULT_ASYNC, AsyncPolicy, RateLimit, Scale
from .load import Load

__all__ = ["Address", "Canary", "Declared", "Gateway", "Route", "RouteTable"]

log = logging.getLogger(__name__)

Upstream = tuple[str, int]
# Where the proxy connects: (host, port) over plain HTTP, (host, port, context, server
# name) over TLS; its upstream connections are pooled by this.
Address = tuple[str, int] | tuple[str, int, SSLContext, str | None]


@dataclass(frozen=True)
class Declared:
    """A function the repository declares, as the status store sees it."""

    phase: str  # Pending, Building, Ready, Failed, Invalid, Disabled
    message: str | None = None
    http: bool = True  # False: declared without an http trigger, so never callable
    # what becomes of its asynchronous invocations, and the queue triggers' subjects
    async_policy: AsyncPolicy = DEFAULT_ASYNC
    subjects: tuple[str, ...] = ()


@dataclass(frozen=True)
class Gateway:
    """An HTTP server that a route's calls go through, e.g. the Kubernetes API server.

    A call through it connects to ``host:port`` (over TLS with ``ssl``, checking
    the certificate against ``server_hostname``, by default ``host``) rather than
    to an upstream, and sends ``path_prefix`` followed by the path it would have
    sent (``/``, the path after ``/fn/{env}/{name}/``, the query). For the API
    server's service proxy::

        Gateway("10.0.0.1", 6443, "/api/v1/namespaces/prod/services/hello:80/proxy",
                (("Authorization", "Bearer ..."),), ssl=context)

    ``Host`` is the gateway's (``host``, with ``:port`` unless it is the scheme's
    default) and ``headers`` are added. The client's own ``Authorization`` is
    dropped: the gateway would take it for credentials. The client's Host still
    makes ``X-Forwarded-Host``; hop-by-hop and forwarding headers are as without
    a gateway. ``headers`` are left out of ``repr``, so a token in them never
    reaches a log line that way. ``authorization``, when given, is asked for the
    ``Authorization`` header on every call (a token that is renewed while the
    proxy runs); it must answer at once, without I/O.

    Calls of every route through the same gateway share connections: they are
    pooled by :attr:`address`.
    """

    host: str
    port: int
    path_prefix: str = ""  # "" or "/..." with no trailing slash, percent-encoded
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    ssl: SSLContext | None = None
    server_hostname: str | None = None
    authorization: Callable[[], str | None] | None = field(default=None, repr=False, compare=False)
    # worked out once: the path prefix and header lines the proxy writes, and where it connects
    prefix: bytes = field(init=False, repr=False, compare=False)
    head: bytes = field(init=False, repr=False, compare=False)
    address: Address = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prefix = self.path_prefix
        if prefix and (prefix[0] != "/" or prefix[-1] == "/" or _NOT_IN_PATH & set(prefix)):
            raise ValueError(f"gateway path prefix {prefix!r}: not a path without a final /")
        for name, value in self.headers:
            # (the value is not named: it may be a token)
            if not _TOKEN.fullmatch(name) or name.lower() in _OWN_HEADERS:
                raise ValueError(f"gateway header {name!r}: not a name it may set")
            if "\r" in value or "\n" in value:
                raise ValueError(f"gateway header {name!r}: its value has a line break")
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        if self.port != (80 if self.ssl is None else 443):
            host += f":{self.port}"
        lines = "".join(f"{name}: {value}\r\n" for name, value in (("host", host), *self.headers))
        address = (
            (self.host, self.port)
            if self.ssl is None
            else (self.host, self.port, self.ssl, self.server_hostname)
        )
        object.__setattr__(self, "prefix", prefix.encode("ascii"))
        object.__setattr__(self, "head", lines.encode("latin-1"))
        object.__setattr__(self, "address", address)

    def lines(self) -> bytes:
        """The header lines of a call through the gateway, its current Authorization included."""
        value = self.authorization() if self.authorization is not None else None
        if not value or "\r" in value or "\n" in value:
            return self.head
        return self.head + b"authorization: " + value.encode("latin-1") + b"\r\n"


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_NOT_IN_PATH = frozenset(" ?#\r\n")
# the proxy writes these itself
_OWN_HEADERS = frozenset(("host", "content-length", "transfer-encoding", "connection"))


@dataclass(frozen=True)
class Canary:
    """A new revision that takes ``percent`` of a function's calls during a rollout: the
    route named ``name`` (``function@revision``). Every ``100`` calls, exactly ``percent``
    go to it, spread evenly (``turn`` counts them, across the function's routes)."""

    name: str
    percent: int
    turn: itertools.count = field(default_factory=itertools.count, compare=False, repr=False)
    # [calls sent as the share, of them answered 5xx (or timed out)]: the verdict's only
    # data (calls at the candidate's own URL are not the share, and could be made up)
    counts: list[int] = field(default_factory=lambda: [0, 0], compare=False, repr=False)

    def takes(self) -> bool:
        """Whether the next call goes to the canary."""
        return next(self.turn) * self.percent % 100 < self.percent

    def answered(self, status: int) -> None:
        self.counts[0] += 1
        if status >= 500:
            self.counts[1] += 1


@dataclass(frozen=True)
class Route:
    """One function of one environment. No upstreams means known but not ready (503).

    With a ``gateway``, calls connect to it, and it finds the function itself:
    ``upstreams`` then only say whether the function is ready.
    """

    env: str
    name: str
    timeout_sec: float
    upstreams: tuple[Upstream, ...] = ()
    # why the last replica that left the route ended (e.g. "OOMKilled: ..."), so a call it
    # was answering can say why it got a 502
    last_exit: str | None = None
    # None: calls connect to the upstream picked; else to the gateway (see Gateway)
    gateway: Gateway | None = None
    # replicas serving when one upstream stands for several (a Service, the API server's
    # proxy): the backend counts them; None: one replica per upstream
    available: int | None = None
    # the function's pages share the server's origin (sameOrigin in its manifest): the
    # proxy leaves out its sandboxing Content-Security-Policy
    same_origin: bool = False
    # a header line the proxy adds to every call (``x-sless-replica: KEY``): the local
    # backend's replicas refuse calls without it, so nobody reaches them but the proxy
    proof: bytes = b""
    # the function's replicas policy when it is autoscaled (None: a fixed count). With one,
    # no upstream means scaled to zero: a call waits for a replica rather than a 503
    scale: Scale | None = None
    concurrency: int = 0  # in-flight calls per replica at most; 0: no limit
    rate_limit: RateLimit | None = None
    max_body_bytes: int | None = None  # the function's own limit (the proxy's stays a ceiling)
    runtime: str = ""  # for the cold-start metrics
    websocket: bool = False  # a websocket trigger: Upgrade: websocket requests are passed on
    plain: bool = True  # plain calls are served (False: only a websocket trigger)
    # its handler reads bodies as they come (stream.request): the proxy passes them on as
    # they arrive and holds none whole, so its own limit is no ceiling on max_body_bytes
    body_streamed: bool = False
    # the stream block's limits, which the proxy holds too (0: no stream block)
    stream_idle_sec: float = 0.0
    stream_max_sec: float = 0.0
    # why the last start of a replica failed, while the crash-loop backoff holds (until
    # ``retry_at``, monotonic): a call that would wait for a start answers 502 with it
    failed: str | None = None
    retry_at: float = 0.0
    # its last good version is being started again (the reconciler's start-up, after a
    # stop): a call waits for it, as for a scale from zero, rather than a 503
    starting: bool = False
    # a rollout under way: the new revision that takes a share of the calls (None: none)
    canary: Canary | None = None
    # what the function's calls cost now: the same object across every route the function
    # has while it is deployed (RouteTable.set carries it over)
    load: Load = field(default_factory=Load, compare=False, repr=False)
    _turn: itertools.count = field(default_factory=itertools.count, compare=False, repr=False)
    # whether calls count in ``load``: only what the autoscaler or a concurrency limit
    # reads (a fixed count without limits costs the proxy nothing more per call)
    counted: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "counted", self.scale is not None or self.concurrency > 0)

    @property
    def serving(self) -> int:
        """How many replicas serve the function."""
        return len(self.upstreams) if self.available is None else self.available

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
        # (env, function) -> {"r3" or a revision id: the name of the route serving it}
        self._revisions: dict[tuple[str, str], dict[str, str]] = {}
        self._closed: frozenset[str] = frozenset()  # environments being torn down
        self._write = threading.Lock()
        self._watchers: list[Callable[[str, str], None]] = []
        self._declaration_watchers: list[Callable[[], None]] = []

    def watch(self, changed: Callable[[str, str], None]) -> None:
        """Call ``changed(env, name)`` after every change of a route, from the thread that
        made it: it must return at once (the proxy's activator hands it to its loop)."""
        self._watchers.append(changed)

    def _changed(self, env: str, name: str) -> None:
        for changed in self._watchers:
            try:
                changed(env, name)
            except Exception:  # a watcher's bug must not stop a backend's update
                log.exception("route watcher failed for %s/%s", env, name)

    def watch_declarations(self, changed: Callable[[], None]) -> None:
        """Call ``changed()`` after what an environment declares is replaced (from that
        thread: it must return at once)."""
        self._declaration_watchers.append(changed)

    def all_declared(self) -> dict[str, dict[str, Declared]]:
        """Every environment's declarations (a snapshot: never changed in place)."""
        return self._declared

    def all(self) -> list[Route]:
        """Every route, for the autoscaler's tick."""
        return list(self._routes.values())

    def close(self, env: str) -> None:
        """Forget ``env`` and ignore what is said of it until :meth:`reopen`: a pass still
        running for it cannot bring a route back while it is torn down."""
        with self._write:
            self._closed = self._closed | {env}
            self._declared = {e: d for e, d in self._declared.items() if e != env}
            gone = [key for key in self._routes if key[0] == env]
            self._routes = {key: r for key, r in self._routes.items() if key[0] != env}
            self._revisions = {k: v for k, v in self._revisions.items() if k[0] != env}
        for key in gone:
            self._changed(*key)

    def reopen(self, env: str) -> None:
        with self._write:
            self._closed = self._closed - {env}

    def declared(self, env: str, name: str) -> Declared | None:
        return self._declared.get(env, {}).get(name)

    def declare(self, env: str, functions: dict[str, Declared]) -> None:
        """Replace what ``env`` declares, whole (an empty mapping forgets the environment)."""
        with self._write:
            if env in self._closed:
                return
            declared = {**self._declared, env: dict(functions)}
            if not functions:
                declared.pop(env)
            self._declared = declared
        for changed in self._declaration_watchers:
            try:
                changed()
            except Exception:  # a watcher's bug must not stop a pass
                log.exception("declarations watcher failed for %s", env)

    def get(self, env: str, name: str) -> Route | None:
        return self._routes.get((env, name))

    def set(self, route: Route) -> None:
        with self._write:
            if route.env in self._closed:
                return
            key = (route.env, route.name)
            old = self._routes.get(key)
            if old is not None:  # the function's load goes on across its routes
                object.__setattr__(route, "load", old.load)
            self._routes = {**self._routes, key: route}
        self._changed(route.env, route.name)

    def remove(self, env: str, name: str) -> None:
        with self._write:
            routes = dict(self._routes)
            gone = routes.pop((env, name), None)
            self._routes = routes
        if gone is not None:
            self._changed(env, name)

    def set_revisions(self, env: str, name: str, aliases: Mapping[str, str]) -> None:
        """How ``/fn/{env}/{name}@{ref}/`` finds its route from now on: ``aliases`` maps
        each ref (``rN``, a revision id) to the name of the route serving that revision
        (``name`` itself for the one that takes the traffic); empty: no revision URLs."""
        # changed in place, not swapped whole: one entry per function, and a deploy of
        # each of 10,000 must not copy them all; a reader's single .get() sees the old or
        # the new mapping (each is replaced whole), never half of one
        with self._write:
            if env in self._closed:
                return
            if aliases:
                self._revisions[(env, name)] = dict(aliases)
            else:
                self._revisions.pop((env, name), None)

    def revision(self, env: str, name: str) -> Route | None:
        """The route of ``name@ref`` (a revision's URL), if that revision is kept."""
        function, _, ref = name.partition("@")
        target = self._revisions.get((env, function), {}).get(ref)
        return None if target is None else self._routes.get((env, target))

    def revision_refs(self, env: str, name: str) -> list[str] | None:
        """The ``rN`` of every kept revision of ``name``, newest first; None: it has none."""
        aliases = self._revisions.get((env, name))
        if not aliases:
            return None
        numbers = [int(ref[1:]) for ref in aliases if ref[:1] == "r" and ref[1:].isdigit()]
        return [f"r{n}" for n in sorted(numbers, reverse=True)]

    def revision_aliases(self, env: str, name: str) -> Mapping[str, str] | None:
        """The refs of ``name``'s kept revisions (as :meth:`set_revisions` was given
        them); a new object whenever they change."""
        return self._revisions.get((env, name))

    def revision_number(self, env: str, route_name: str) -> str | None:
        """The ``rN`` of the revision the route ``route_name`` serves (``name`` or
        ``name@id``); None when its function keeps no revisions."""
        aliases = self._revisions.get((env, route_name.partition("@")[0]), {})
        for ref, target in aliases.items():
            if target == route_name and ref[:1] == "r" and ref[1:].isdigit():
                return ref
        return None

    def names(self, env: str) -> list[str]:
        return sorted(name for e, name in self._routes if e == env)
