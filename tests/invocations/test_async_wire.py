"""Submissions on the wire, through a real ``serve``: the ``/fn/`` listener takes a
submission itself (proxy/handoff.py), not through an ASGI cycle, and what a client
can do on a connection still works: keep-alive, pipelining (the second one takes
the ASGI way), ``Expect: 100-continue``, a chunked body past the limit (413, nothing
stored), HTTP/1.0."""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlsplit

from ..test_serve import HTTP, git_daemon, git_root, manifest, setup
from .test_async_serve import FLAKY, wait_ended

__all__ = ["git_daemon", "git_root", "setup"]  # the fixtures, shared with test_serve

LIMIT = 256


def served(setup: Any) -> Any:
    setup.push(
        {
            "orders/sless.yaml": manifest("orders", HTTP, f"    maxBodyBytes: {LIMIT}"),
            "orders/handler.py": FLAKY,
        }
    )
    return setup.serve()


def connect(server: Any) -> socket.socket:
    url = urlsplit(server.base)
    return socket.create_connection((url.hostname, url.port), timeout=10)


def submission(order: int, version: str = "1.1", extra: str = "") -> bytes:
    body = json.dumps({"order": order}).encode()
    head = (
        f"POST /fn/prod/orders/o{order} HTTP/{version}\r\nHost: t\r\n"
        f"Prefer: respond-async\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def read_answer(sock: socket.socket, buffered: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response (with a Content-Length) from ``sock``; what follows stays buffered."""
    while b"\r\n\r\n" not in buffered:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole head: {bytes(buffered)!r}"
        buffered += chunk
    head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed inside a body"
        rest += chunk
    buffered[:] = rest[length:]
    return int(lines[0].split()[1]), headers, rest[:length]


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_pipelined_and_kept_alive_submissions_are_each_taken_in_order(setup):
    server = served(setup)
    with connect(server) as sock:
        sock.sendall(submission(1) + submission(2) + submission(3))  # one write
        buffered = bytearray()
        answers = [read_answer(sock, buffered) for _ in range(3)]
        sock.sendall(submission(4))  # and again on the same connection
        answers.append(read_answer(sock, buffered))
    assert [status for status, _, _ in answers] == [202] * 4
    ids = [json.loads(body)["id"] for _, _, body in answers]
    assert len(set(ids)) == 4
    for order, (_, headers, body) in enumerate(answers, 1):
        assert headers["location"] == f"/api/invocations/{json.loads(body)['id']}"
        assert headers["content-type"] == "application/json"
        record = wait_ended(server, headers["location"])
        assert record["status"] == "succeeded", record
        result = json.loads(record["response"]["body"])
        assert result["order"] == order and result["path"] == f"/o{order}"


def test_expect_100_continue_is_answered_before_the_body(setup):
    server = served(setup)
    body = b'{"order": 5}'
    with connect(server) as sock:
        sock.sendall(
            b"POST /async/prod/orders/ HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        buffered = bytearray()
        status, _, _ = read_answer(sock, buffered)
        assert status == 100
        sock.sendall(body)
        status, headers, _ = read_answer(sock, buffered)
    assert status == 202
    assert wait_ended(server, headers["location"])["status"] == "succeeded"


def test_a_chunked_body_past_the_limit_is_413_and_nothing_is_stored(setup):
    server = served(setup)
    with connect(server) as sock:
        sock.sendall(
            b"POST /fn/prod/orders/ HTTP/1.1\r\nHost: t\r\nPrefer: respond-async\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(4):
            sock.sendall(b"%x\r\n%b\r\n" % (100, b"x" * 100))  # 400 bytes > 256
        status, headers, body = read_answer(sock, bytearray())
        assert status == 413, body
        assert headers["connection"] == "close"
        assert f"larger than {LIMIT} bytes" in json.loads(body)["error"]
        assert closed(sock)
    # one declared too long is refused from its head
    with connect(server) as sock:
        sock.sendall(
            b"POST /fn/prod/orders/ HTTP/1.1\r\nHost: t\r\nPrefer: respond-async\r\n"
            b"Content-Length: 100000\r\n\r\n"
        )
        status, _, _ = read_answer(sock, bytearray())
        assert status == 413
    assert server.client.get("/api/v1/invocations").json() == []


def test_a_refusal_from_the_head_keeps_the_connection(setup):
    server = served(setup)
    with connect(server) as sock:
        buffered = bytearray()
        sock.sendall(submission(1).replace(b"/fn/prod/orders/", b"/fn/prod/nobody/"))
        status, headers, _ = read_answer(sock, buffered)
        assert status == 404 and headers.get("connection") != "close"
        sock.sendall(submission(2))  # the same connection goes on
        status, headers, _ = read_answer(sock, buffered)
        assert status == 202
    assert wait_ended(server, headers["location"])["status"] == "succeeded"


def test_an_http_1_0_submission_is_answered_and_closed(setup):
    server = served(setup)
    with connect(server) as sock:
        sock.sendall(submission(6, version="1.0"))
        status, headers, _ = read_answer(sock, bytearray())
        assert status == 202
        assert headers["connection"] == "close"
        assert closed(sock)
    assert wait_ended(server, headers["location"])["status"] == "succeeded"
