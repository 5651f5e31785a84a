"""HTTP details of the invoke proxy shared by its ASGI path and its fast path.

Which function a path names, the request head sent upstream (hop-by-hop
headers removed, ``X-Forwarded-*`` and ``X-Request-Id`` set), the response
headers passed back, and the proxy's own JSON errors.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Sequence
from urllib.parse import unquote_to_bytes

__all__ = [
    "HOP_BY_HOP",
    "Call",
    "error_body",
    "new_request_id",
    "request_head",
    "request_id_of",
    "response_headers",
    "split_target",
]

Headers = Sequence[tuple[bytes, bytes]]

PREFIX = b"/fn/"
_NAME = re.compile(r"[a-z](?:[-a-z0-9]*[a-z0-9])?")
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._-]{1,128}")
LABEL_MAX = 64  # how much of an unknown env or name is kept in a record
_getrandbits = random.getrandbits
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

# What the request header loop does with a name: absent = pass on unchanged. Expect is
# answered by the proxy's own server; the X-Forwarded-* it sets are never taken from the client.
_DROP, _CONNECTION, _HOST, _XFF, _REQID, _LENGTH, _CHUNKED = range(7)
_REQUEST_SPECIAL = {name: _DROP for name in HOP_BY_HOP} | {
    b"expect": _DROP,
    b"x-forwarded-proto": _DROP,
    b"x-forwarded-host": _DROP,
    b"x-forwarded-prefix": _DROP,
    b"connection": _CONNECTION,
    b"host": _HOST,
    b"x-forwarded-for": _XFF,
    b"x-request-id": _REQID,
    b"content-length": _LENGTH,
    b"transfer-encoding": _CHUNKED,
}
# The serving HTTP server writes its own Date; the proxy writes its own request id.
_RESPONSE_DROP = HOP_BY_HOP | {b"date", b"x-request-id"}
# Whatever Connection names, these stay: the upstream needs them to read the request.
_FRAMING = frozenset((b"", b"host", b"content-length"))

NO_BODY, FIXED, CHUNKED = range(3)


class Call:
    """One request through the proxy, as it will be recorded; ``status`` is what the client got."""

    __slots__ = (
        "env",
        "known",
        "method",
        "name",
        "path",
        "request_id",
        "started",
        "status",
        "wall",
    )

    def __init__(self, env: str, name: str, method: str, path: str) -> None:
        self.env, self.name, self.method, self.path = env, name, method, path
        self.known = False
        self.request_id = b""
        self.status = 0
        self.started = time.perf_counter()
        self.wall = time.time()


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
    env, env_ok = _segment(env_raw)
    name, name_ok = _segment(name_raw)
    return env, name, bool(sep) and env_ok and name_ok


def _segment(raw: bytes) -> tuple[str, bool]:
    if not raw:
        return "", False
    text = (unquote_to_bytes(raw) if b"%" in raw else raw).decode("utf-8", "replace")
    if _NAME.fullmatch(text):
        return text, True
    return text[:LABEL_MAX], False


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


def request_head(
    method: bytes,
    target: bytes,
    headers: Headers,
    client_host: str | None,
    scheme: str,
    env: str,
    name: str,
) -> tuple[bytes, int, int, bytes]:
    """(upstream request head, body framing, Content-Length or -1, request id).

    ``headers`` have lower-case names, as both uvicorn and the ASGI spec give them.
    """
    parts = [method, b" ", target, b" HTTP/1.1\r\n"]
    connection = host = forwarded_for = request_id = None
    length = -1
    body_mode = NO_BODY
    special = _REQUEST_SPECIAL.get
    for header, value in headers:
        kind = special(header)
        if kind is None:
            parts += (header, b": ", value, b"\r\n")
        elif kind == _HOST:
            host = value
            parts += (header, b": ", value, b"\r\n")
        elif kind == _LENGTH:
            length = int(value)
            body_mode = FIXED
            parts += (header, b": ", value, b"\r\n")
        elif kind == _REQID:
            request_id = value
        elif kind == _XFF:
            forwarded_for = value
        elif kind == _CHUNKED:
            body_mode = CHUNKED if body_mode == NO_BODY else body_mode
        elif kind == _CONNECTION:
            connection = value
    if connection is not None:
        parts = _without_connection_tokens(parts, connection)
    if body_mode == CHUNKED:
        parts.append(b"transfer-encoding: chunked\r\n")
    if request_id is None or not _REQUEST_ID.fullmatch(request_id):
        request_id = new_request_id()
    if client_host:
        addr = client_host.encode("latin-1")
        forwarded_for = forwarded_for + b", " + addr if forwarded_for else addr
    if forwarded_for:
        parts += (b"x-forwarded-for: ", forwarded_for, b"\r\n")
    if host is not None:
        parts += (b"x-forwarded-host: ", host, b"\r\n")
    parts += (
        b"x-forwarded-proto: ",
        scheme.encode("ascii"),
        b"\r\nx-forwarded-prefix: /fn/",
        env.encode("ascii"),
        b"/",
        name.encode("ascii"),
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
    upstream: Headers, connection: bytes | None, request_id: bytes
) -> tuple[list[bytes], bool]:
    """The upstream's response headers as the client gets them, serialised; and whether
    they include Content-Length. ``connection`` is the upstream's Connection header."""
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
    return out, has_length


def error_body(message: str, call: Call) -> bytes:
    return json.dumps({"error": message, "function": call.name, "env": call.env}).encode()
