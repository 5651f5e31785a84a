"""HTTP details of the invoke proxy shared by its ASGI path and its fast path.

Which function a path names, the request head sent upstream (hop-by-hop headers
removed, ``X-Forwarded-*``, ``Forwarded`` and ``X-Request-Id`` set), the response
headers passed back, the proxy's own JSON errors, and the :class:`Limits` of the edge.

Forwarding headers: by default the proxy is the edge. Whatever the client
sent as ``Forwarded``, ``X-Real-IP`` or ``X-Forwarded-*`` is dropped, and the
function gets the proxy's own: ``X-Forwarded-For`` (the peer's address),
``-Proto``, ``-Host``, ``-Prefix`` and an RFC 7239 ``Forwarded`` element. Only
a peer inside one of the ``trusted_proxies`` CIDRs (a load balancer in front)
has its ``X-Forwarded-For`` chain and ``Forwarded`` elements kept (the peer
appended), and its ``X-Forwarded-Proto``/``-Host`` believed.

The server's own credentials never reach a function: the dashboard's session
cookie (:data:`SESSION_COOKIE`) is cut out of ``Cookie`` (the caller's other
cookies stay), and an ``Authorization: Bearer`` that is one of the server's
tokens (:class:`Withheld`) is dropped; any other ``Authorization`` is the
function's and passes. Every response carries :data:`SANDBOX_CSP` unless the
function's route says ``same_origin``: its page then runs in an opaque origin,
and cannot act as the dashboard's (a function's own CSP is passed on beside it;
a browser enforces both).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import random
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import unquote_to_bytes

from .. import telemetry
from ..state.routes import Gateway
from ..telemetry.tracecontext import TRACEPARENT

__all__ = [
    "HOP_BY_HOP",
    "REPLICA_KEY_HEADER",
    "SANDBOX_CSP",
    "SESSION_COOKIE",
    "Call",
    "Limits",
    "Peer",
    "Withheld",
    "error_body",
    "new_request_id",
    "parse_networks",
    "peer_of",
    "request_head",
    "request_id_of",
    "response_headers",
    "split_target",
]

Headers = Sequence[tuple[bytes, bytes]]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Limits:
    """What the server in front of the proxy accepts from a client (``proxy.config``).

    Each default can be changed through the environment variable named in
    :data:`LIMITS_ENV` (read by :meth:`from_env`, which ``proxy.config`` uses
    when it is given no ``limits``).
    """

    # request line plus header lines, in bytes; more is 431 and the connection is closed
    max_head_bytes: int = 64 * 1024
    # from the first byte of a request to the end of its head; then 408 and close
    head_timeout: float = 10.0
    # the longest pause while a request body is being received; then 408 (or a close
    # once the response has started). Pauses the proxy causes itself (upstream slow to
    # read) do not count.
    body_timeout: float = 30.0
    # a new connection that sends nothing is closed after this
    idle_timeout: float = 10.0
    # between requests on a kept-alive connection; longer than a browser's or a load
    # balancer's idle time, so the client closes first
    keep_alive_timeout: float = 65.0
    # open connections served at once: a connection opened while this many are open has
    # its request answered 503 (JSON, Connection: close) and is closed; those already
    # open are served on. A silent one goes at idle_timeout.
    max_connections: int = 1000

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Limits:
        """The defaults, with any ``SLESS_PROXY_*`` variable of :data:`LIMITS_ENV` applied."""
        environ = os.environ if environ is None else environ
        values: dict[str, float | int] = {}
        for field in fields(cls):
            raw = environ.get(LIMITS_ENV[field.name])
            if raw is None or not raw.strip():
                continue
            kind = int if field.type in ("int", int) else float
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{LIMITS_ENV[field.name]}={raw!r} is not a number") from None
            if value <= 0:
                raise ValueError(f"{LIMITS_ENV[field.name]}={raw!r} must be positive")
            values[field.name] = value
        return cls(**values)  # type: ignore[arg-type]


LIMITS_ENV = {
    "max_head_bytes": "SLESS_PROXY_MAX_HEAD_BYTES",
    "head_timeout": "SLESS_PROXY_HEAD_TIMEOUT",
    "body_timeout": "SLESS_PROXY_BODY_TIMEOUT",
    "idle_timeout": "SLESS_PROXY_IDLE_TIMEOUT",
    "keep_alive_timeout": "SLESS_PROXY_KEEP_ALIVE_TIMEOUT",
    "max_connections": "SLESS_PROXY_MAX_CONNECTIONS",
}

PREFIX = b"/fn/"
_NAME = re.compile(r"[a-z](?:[-a-z0-9]*[a-z0-9])?")
# a function's name, or one of its revisions: name@r3, name@<revision id>
_FUNCTION = re.compile(r"[a-z](?:[-a-z0-9]*[a-z0-9])?(?:@[a-z0-9]{1,32})?")
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._-]{1,128}")
LABEL_MAX = 64  # how much of an unknown env or name is kept in a record
_getrandbits = random.Random().getrandbits  # its own: the global one stays the caller's
_UUID4_CLEAR = ~(0xF000 << 64 | 0xC000 << 48)  # the version and variant bits
_UUID4_SET = 0x4000 << 64 | 0x8000 << 48

# RFC 9110 §7.6.1.
HOP_BY_HOP = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    )
)

# What the request header loop does with a name: _PASS = pass on unchanged. Expect is
# answered by the proxy's own server. Forwarding headers are kept only from a trusted peer.
# the header a local replica checks (runtimes' REPLICA_KEY_HEADER; see Route.proof)
REPLICA_KEY_HEADER = b"x-sless-replica"
_PASS, _DROP, _CONNECTION, _HOST, _XFF, _REQID, _LENGTH, _CHUNKED = range(8)
_FWD, _XFP, _XFH, _AUTH, _COOKIE, _AUTHORIZATION, _TRACE, _TRACESTATE = range(8, 16)
_REQUEST_SPECIAL = {name: _DROP for name in HOP_BY_HOP} | {
    b"expect": _DROP,
    b"x-real-ip": _DROP,
    REPLICA_KEY_HEADER: _DROP,  # only the proxy's own proof reaches a replica
    b"x-forwarded-prefix": _DROP,
    b"connection": _CONNECTION,
    b"host": _HOST,
    b"x-forwarded-for": _XFF,
    b"x-forwarded-proto": _XFP,
    b"x-forwarded-host": _XFH,
    b"forwarded": _FWD,
    b"x-request-id": _REQID,
    b"content-length": _LENGTH,
    b"transfer-encoding": _CHUNKED,
    b"authorization": _AUTHORIZATION,  # as _AUTH, and never the server's own token
    b"cookie": _COOKIE,  # passed on without the dashboard's session cookie
    b"traceparent": _TRACE,  # kept when valid, else a trace is started (trace_context)
    b"tracestate": _TRACESTATE,  # only beside a traceparent that is kept
}
_XF = b"x-forwarded-"
_SCHEMES = {b"http": b"http", b"https": b"https"}
# Every name seen so far with what to do with it; bounded, any client can send any name.
_kinds = dict(_REQUEST_SPECIAL)
_KINDS_MAX = 4096


def _kind_of(name: bytes) -> int:
    """What to do with a header name not seen before (any X-Forwarded-* is dropped)."""
    kind = _DROP if name.startswith(_XF) else _PASS
    if name.startswith(b"impersonate-"):  # Kubernetes would act on them with its credentials
        kind = _AUTH
    if len(_kinds) < _KINDS_MAX:
        _kinds[name] = kind
    return kind


# The serving HTTP server writes its own Date; the proxy writes its own request id.
# x-sless-cold-start is the proxy's to say (a function could pretend)
_RESPONSE_DROP = HOP_BY_HOP | {b"date", b"x-request-id", b"x-sless-cold-start"}
# Whatever Connection names, these stay: the upstream needs them to read the request.
_FRAMING = frozenset((b"", b"host", b"content-length"))

NO_BODY, FIXED, CHUNKED = range(3)

# The dashboard's session cookie (access.COOKIE): never passed on to a function.
SESSION_COOKIE = "sless_session"
_SESSION = SESSION_COOKIE.encode()
# On every /fn/ response unless the function opts out (sameOrigin): an opaque origin, where
# scripts run but cannot read the dashboard or the API with the viewer's session.
SANDBOX_CSP = b"sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads"
_CSP_LINE = (b"content-security-policy", b": ", SANDBOX_CSP, b"\r\n")


class Withheld:
    """The server's own tokens: an ``Authorization: Bearer`` holding one is not passed on."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: Iterable[str | None] = ()) -> None:
        self.tokens = tuple(t.encode() for t in tokens if t)

    def issued(self, value: bytes) -> bool:
        """Whether ``value`` (an Authorization header) is a bearer token of the server's,
        compared in constant time against each."""
        scheme, _, token = value.strip().partition(b" ")
        if not self.tokens or scheme.lower() != b"bearer":
            return False
        token = token.strip()
        found = False
        for mine in self.tokens:
            found |= hmac.compare_digest(token, mine)
        return found


NOTHING_WITHHELD = Withheld()


def _without_session(value: bytes) -> bytes:
    """A Cookie header less the session cookie's pairs (b"" when nothing is left)."""
    kept = [pair for pair in value.split(b";") if pair.partition(b"=")[0].strip() != _SESSION]
    return b";".join(kept).strip()


class Call:
    """One request through the proxy, as it will be recorded; ``status`` is what the client got."""

    __slots__ = (
        "canary",
        "cold",
        "declared",
        "env",
        "known",
        "load",
        "method",
        "name",
        "opened",
        "path",
        "request_id",
        "started",
        "status",
        "trace",
        "trace_id",
        "wall",
    )

    def __init__(self, env: str, name: str, method: str, path: str) -> None:
        self.env, self.name, self.method, self.path = env, name, method, path
        self.known = False  # routed or declared: counted and recorded under its name
        self.declared: Any = None  # the routes.Declared of a name with no serving route
        self.request_id, self.status = b"", 0
        self.started, self.wall = time.perf_counter(), time.time()
        self.load: Any = None  # the function's load.Load while the call counts in it
        # (perf_counter when the replica that the call waited for was ready, the route's
        # runtime) of a call that waited for a start; None: it did not
        self.cold: tuple[float, str] | None = None
        # the routes.Canary whose share this call was sent as (None: not a canary's): its
        # outcome counts in the rollout's verdict
        self.canary: Any = None
        # with spans exported (telemetry.ON): (the traceparent the call went on with, naming
        # the proxy's span; the caller's span id, None for a new trace)
        self.trace: tuple[bytes, bytes | None] | None = None
        self.trace_id = b""  # when it is not its request id (b"": it is, as for most)
        self.opened: Any = None  # a streamwatch.Opened: a stream or a WebSocket under way


def split_target(raw: bytes) -> tuple[str, str, bool, bytes]:
    """``/fn/{env}/{name}/{tail}`` → (env, name, both valid, tail), names decoded.

    Works on the raw path so that ``%2f`` inside a segment is not a separator.
    """
    if not raw.startswith(PREFIX):
        return "", "", False, b""
    rest = raw[4:]
    slash = rest.find(b"/")
    end = rest.find(b"/", slash + 1) if slash >= 0 else -1
    key, tail = (rest, b"") if end < 0 else (rest[:end], rest[end + 1 :])
    names = _names.get(key)
    if names is None:
        names = _names_of(key)
        if len(_names) < _NAMES_MAX:
            _names[key] = names
    return names[0], names[1], names[2], tail


# Decoded and checked ``env/name`` prefixes: the same few recur on every call. Bounded,
# since a client can send any number of different ones.
_names: dict[bytes, tuple[str, str, bool]] = {}
_NAMES_MAX = 4096


def _names_of(key: bytes) -> tuple[str, str, bool]:
    env_raw, sep, name_raw = key.partition(b"/")
    env, env_ok = _segment(env_raw, _NAME)
    name, name_ok = _segment(name_raw, _FUNCTION)
    return env, name, bool(sep) and env_ok and name_ok


def _segment(raw: bytes, pattern: re.Pattern[str]) -> tuple[str, bool]:
    if not raw:
        return "", False
    text = (unquote_to_bytes(raw) if b"%" in raw else raw).decode("utf-8", "replace")
    if pattern.fullmatch(text):
        return text, True
    return text[:LABEL_MAX], False


def trace_context(
    traceparent: bytes | None, tracestate: bytes | None, call: Call | None = None
) -> tuple[bytes, ...]:
    """The trace context header lines a call goes on with: the caller's ``traceparent``
    (and ``tracestate``) when valid, else a new trace, sampled (W3C Trace Context §4.3:
    an invalid traceparent starts a new trace, and its tracestate is dropped).

    A call with neither a trace nor a request id of its own (most) gets its new trace
    from the request id the proxy made, in :func:`request_head`: a uuid4 in hex, whose
    random bits serve as the trace id, and its last 64 as the parent id (never zero: the
    uuid's variant bits are set); no more randomness is drawn on the hot path.

    ``call.trace_id`` is its trace id. With spans exported (``telemetry.ON``), the proxy's
    span is the function's parent: a caller's trace goes on with a new parent id, and
    ``call.trace`` keeps what the span is made of for ``ProxyApp.finish``."""
    if traceparent and TRACEPARENT.fullmatch(traceparent):
        if call is not None:
            call.trace_id = traceparent[3:35]
            if telemetry.ON:
                caller, span = traceparent[36:52], _getrandbits(64) | 1
                traceparent = b"00-%s-%016x-%s" % (call.trace_id, span, traceparent[53:55])
                call.trace = (traceparent, caller)
        if tracestate:
            return (b"traceparent: ", traceparent, b"\r\ntracestate: ", tracestate, b"\r\n")
        return (b"traceparent: ", traceparent, b"\r\n")
    trace_id = b"%032x" % (_getrandbits(128) | 1)
    if call is not None:
        call.trace_id = trace_id
        if telemetry.ON:
            call.trace = (b"00-" + trace_id + b"-" + trace_id[16:] + b"-01", None)
    return (b"traceparent: 00-", trace_id, b"-", trace_id[16:], b"-01\r\n")


def new_request_id() -> bytes:
    """A uuid4 in hex. Drawn from ``random``, not ``os.urandom``: an id must be unique, not
    secret, and a getrandom() syscall per call is measurable here."""
    return b"%032x" % (_getrandbits(128) & _UUID4_CLEAR | _UUID4_SET)


def request_id_of(headers: Headers) -> bytes:
    """The client's X-Request-Id if it is acceptable, else a new one."""
    for name, value in headers:
        if name == b"x-request-id" and _REQUEST_ID.fullmatch(value):
            return value
    return new_request_id()


class Peer:
    """The client's end of a connection, as the forwarding headers name it."""

    __slots__ = ("addr", "element", "host", "node", "proto", "scheme", "trusted")

    def __init__(self, addr: bytes, node: bytes, trusted: bool) -> None:
        self.addr = addr  # for X-Forwarded-For; b"" when unknown (a Unix socket)
        self.node = node  # the Forwarded "for=" pair
        self.trusted = trusted  # inside trusted_proxies: its forwarding headers are kept
        # The last request's scheme and Host, and what they made: the same recur.
        self.scheme = ""
        self.host: bytes | None = None
        self.proto = b""
        self.element = b""

    def remember(self, scheme: str, host: bytes | None) -> tuple[bytes, bytes]:
        """(this peer's RFC 7239 Forwarded element for ``scheme`` and ``host``, the scheme)."""
        proto = scheme.encode("ascii")
        element = self.node + b";proto=" + proto
        if host is not None:
            element += b";host=" + _quoted(host)
        self.scheme, self.host, self.proto, self.element = scheme, host, proto, element
        return element, proto


NO_PEER = Peer(b"", b"for=unknown", False)


def parse_networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """``trusted_proxies`` as networks; ValueError names a malformed one."""
    networks = []
    for cidr in cidrs:
        try:
            networks.append(ipaddress.ip_network(cidr.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"trusted proxy {cidr!r} is not an address or CIDR: {exc}") from None
    return tuple(networks)


def peer_of(host: str | None, trusted: Sequence[Network]) -> Peer:
    """The :class:`Peer` for a client address as the server reports it."""
    if not host:
        return NO_PEER
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:  # not an IP address: nothing to trust, quote it as it is
        return Peer(host.encode("latin-1"), b"for=" + _quoted(host.encode("latin-1")), False)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    is_trusted = any(ip in net or (mapped is not None and mapped in net) for net in trusted)
    addr = str(ip).encode("ascii")
    # RFC 7239 §6: an IPv6 node is bracketed, and then quoted (":" is not a token character)
    node = b'for="[' + addr + b']"' if ip.version == 6 else b"for=" + addr
    return Peer(addr, node, is_trusted)


_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _quoted(value: bytes) -> bytes:
    """An RFC 7230 token as it is, anything else as a quoted-string."""
    if _TOKEN.fullmatch(value):
        return value
    return b'"' + value.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"'


def request_head(
    method: bytes,
    target: bytes,
    headers: Headers,
    peer: Peer,
    scheme: str,
    env: str,
    name: str,
    gateway: Gateway | None = None,
    withheld: Withheld = NOTHING_WITHHELD,
    proof: bytes = b"",
    call: Call | None = None,
) -> tuple[bytes, int, int, bytes]:
    """(upstream request head, body framing, Content-Length or -1, request id).

    ``headers`` have lower-case names, as both uvicorn and the ASGI spec give them.
    The server in front has checked them already (one Host, plain chunked).

    Through a ``gateway`` the target follows its path prefix, and Host and the
    gateway's headers are its own. The client's Authorization is dropped then, not
    to be taken for the gateway's credentials (e.g. by the Kubernetes API server);
    the client's Host still makes X-Forwarded-Host and Forwarded's ``host=``.

    The session cookie is cut out of Cookie, and an Authorization holding one of the
    ``withheld`` tokens is dropped (the module docstring).
    """
    if gateway is not None:
        target = gateway.prefix + target
    parts = [method, b" ", target, b" HTTP/1.1\r\n"]
    connection = host = request_id = traceparent = tracestate = None
    forwarded_for = forwarded = forwarded_proto = forwarded_host = None
    length = -1
    body_mode = NO_BODY
    kinds = _kinds.get
    for header, value in headers:
        kind = kinds(header)
        if kind is None:
            kind = _kind_of(header)
        if kind == _PASS:
            parts += (header, b": ", value, b"\r\n")
        elif kind == _HOST:
            host = value
            if gateway is None:
                parts += (header, b": ", value, b"\r\n")
        elif kind == _LENGTH:
            length = int(value)
            body_mode = FIXED
            parts += (header, b": ", value, b"\r\n")
        elif kind == _REQID:
            request_id = value
        elif kind == _TRACE:
            traceparent = value if traceparent is None else b""  # two: neither is valid
        elif kind == _TRACESTATE:  # several headers are one list (W3C Trace Context §3.3)
            tracestate = value if tracestate is None else tracestate + b"," + value
        elif kind == _XFF:  # several headers are one list, in order (RFC 9110 §5.3)
            forwarded_for = value if forwarded_for is None else forwarded_for + b", " + value
        elif kind == _FWD:
            forwarded = value if forwarded is None else forwarded + b", " + value
        elif kind == _XFP:
            forwarded_proto = forwarded_proto or value
        elif kind == _XFH:
            forwarded_host = forwarded_host or value
        elif kind == _CHUNKED:
            body_mode = CHUNKED if body_mode == NO_BODY else body_mode
        elif kind == _CONNECTION:
            connection = value
        elif kind == _COOKIE:
            if _SESSION in value:
                value = _without_session(value)
            if value:
                parts += (header, b": ", value, b"\r\n")
        elif kind == _AUTHORIZATION:
            if gateway is None and not withheld.issued(value):
                parts += (header, b": ", value, b"\r\n")
        elif kind == _AUTH and gateway is None:
            parts += (header, b": ", value, b"\r\n")
    if connection is not None:
        parts = _without_connection_tokens(parts, connection)
    if gateway is not None:  # after: the client's Connection cannot name these away
        parts.append(gateway.lines())
    if proof:  # the route's header line that its replicas check (Route.proof)
        parts.append(proof)
    if body_mode == CHUNKED:
        parts.append(b"transfer-encoding: chunked\r\n")
    if request_id is None or not _REQUEST_ID.fullmatch(request_id):
        request_id = new_request_id()
        if traceparent is None:  # the common case, at the least cost: see trace_context
            parts += (b"traceparent: 00-", request_id, b"-", request_id[16:], b"-01\r\n")
            if telemetry.ON and call is not None:  # the proxy's span: the trace's root
                call.trace = (b"00-" + request_id + b"-" + request_id[16:] + b"-01", None)
        else:
            parts += trace_context(traceparent, tracestate, call)
    else:
        parts += trace_context(traceparent, tracestate, call)
    if host == peer.host and scheme == peer.scheme:
        element, proto = peer.element, peer.proto
    else:
        element, proto = peer.remember(scheme, host)
    if peer.trusted:  # a proxy we trust: its view of the client comes first
        addr = peer.addr
        forwarded_for = forwarded_for + b", " + addr if forwarded_for else addr
        forwarded = forwarded + b", " + element if forwarded else element
        if forwarded_proto is not None:
            proto = _SCHEMES.get(forwarded_proto.strip().lower(), proto)
        if forwarded_host is not None:
            host = forwarded_host
    else:
        forwarded_for, forwarded = peer.addr, element
    if forwarded_for:
        parts += (b"x-forwarded-for: ", forwarded_for, b"\r\n")
    if host is not None:
        parts += (b"x-forwarded-host: ", host, b"\r\n")
    parts += (
        b"x-forwarded-proto: ",
        proto,
        b"\r\nx-forwarded-prefix: /fn/",
        env.encode("ascii"),
        b"/",
        name.encode("ascii"),
        b"\r\nforwarded: ",
        forwarded,
        b"\r\nx-request-id: ",
        request_id,
        b"\r\n\r\n",
    )
    return b"".join(parts), body_mode, length, request_id


def _without_connection_tokens(parts: list[bytes], connection: bytes) -> list[bytes]:
    """``parts`` (request line, then 4 items per header) less the headers Connection names."""
    named = {token.strip().lower() for token in connection.split(b",")} - _FRAMING
    if not named:
        return parts
    kept = parts[:4]
    for i in range(4, len(parts), 4):
        if parts[i] not in named:
            kept += parts[i : i + 4]
    return kept


def response_headers(
    upstream: Headers, connection: bytes | None, request_id: bytes, sandbox: bool = True
) -> tuple[list[bytes], bool]:
    """The upstream's response headers as the client gets them, serialised; and whether
    they include Content-Length. ``connection`` is the upstream's Connection header.
    ``sandbox``: add :data:`SANDBOX_CSP` after them (the function's own CSP stays)."""
    drop = _RESPONSE_DROP
    if connection is not None:
        drop = drop | {token.strip().lower() for token in connection.split(b",")}
    out: list[bytes] = []
    has_length = False
    for name, value in upstream:
        if name not in drop:
            out += (name, b": ", value, b"\r\n")
            if name == b"content-length":
                has_length = True
    out += (b"x-request-id", b": ", request_id, b"\r\n")
    if sandbox:
        out += _CSP_LINE
    return out, has_length


def error_body(message: str, call: Call) -> bytes:
    """The proxy's JSON error; with the phase and message of a declared, unserved function."""
    body: dict[str, Any] = {"error": message, "function": call.name, "env": call.env}
    declared = call.declared
    if declared is not None:
        body["phase"] = declared.phase
        body["message"] = declared.message
    return json.dumps(body).encode()
