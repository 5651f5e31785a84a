"""Request bodies read as they come (issue 30, item 3), from the runtimes as real
processes: with SLESS_STREAM_REQUEST=1 (``stream: {request: true}``) the handler gets the
body as ``event["_stream"]`` (python: a binary file-like object; node: the request, a
Readable) and reads it piece by piece, whatever its size; nothing parses it first.

The handlers are ``uploads`` in tests/data/runtime_fns/{python,node}/."""

from __future__ import annotations

import hashlib
import socket
import sys
from collections.abc import Iterator

import httpx
import pytest

from .test_runtime_streams import (
    read_until,
    runtime,  # noqa: F401 - the runtime fixture, both runtimes
)
from .test_runtimes import FUNCTIONS_DIR, RUNTIMES_DIR, Runtime, Server

MIB = 1 << 20


@pytest.fixture(scope="module")
def server(runtime, tmp_path_factory) -> Iterator[Server]:  # noqa: F811
    logs = tmp_path_factory.mktemp("upload_logs")
    srv = Server(runtime, logs, "uploads.handler", SLESS_STREAM_REQUEST="1").wait_healthy()
    try:
        yield srv
    finally:
        srv.stop()


def pieces(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        piece = bytes([sent // size % 256]) * min(size, total - sent)
        sent += len(piece)
        yield piece


def test_a_chunked_upload_reaches_the_handler_piece_by_piece(server):
    total = 48 * MIB  # over the runtimes' 32 MiB cap on a body they read whole
    digest = hashlib.sha256()
    for piece in pieces(total):
        digest.update(piece)
    reply = httpx.post(f"{server.url}/sum", content=pieces(total), timeout=60)
    assert reply.status_code == 200, reply.text
    got = reply.json()
    assert got["bytes"] == total and got["sha256"] == digest.hexdigest()
    assert got["largest"] <= MIB  # read in pieces, never as one


def test_a_json_body_is_not_parsed_but_read(server):
    body = b'{"n": 1}'
    reply = httpx.post(
        f"{server.url}/sum", content=body, headers={"Content-Type": "application/json"}
    )
    got = reply.json()
    assert got["bytes"] == len(body) and got["parsed"] is False
    assert got["sha256"] == hashlib.sha256(body).hexdigest()


def test_a_body_with_a_length_then_the_next_request_on_the_same_connection(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        first = client.post("/sum", content=b"x" * 300_000).json()
        assert first["bytes"] == 300_000
        second = client.post("/sum", content=b"y" * 10).json()
        assert second["bytes"] == 10 and second["sha256"] == hashlib.sha256(b"y" * 10).hexdigest()


def test_a_body_the_handler_leaves_unread_does_not_become_the_next_request(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.post("/first", content=b"z" * MIB).json() == {"first": 10}
        # the megabyte left unread is not taken for a request: the next one is answered
        assert client.post("/sum", content=b"ok").json()["bytes"] == 2


def test_expect_100_continue_is_answered_before_the_body_is_sent(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /sum HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        )
        assert read_until(sock, b"\r\n\r\n").startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(b"hello")
        assert b'"bytes":5' in read_until(sock, b"}").replace(b" ", b"")


@pytest.fixture(scope="module")
def python_server(tmp_path_factory) -> Iterator[Server]:
    python = Runtime(
        "python3.11", sys.executable, RUNTIMES_DIR / "python3.11", FUNCTIONS_DIR / "python"
    )
    logs = tmp_path_factory.mktemp("upload_logs_py")
    srv = Server(python, logs, "uploads.handler", SLESS_STREAM_REQUEST="1").wait_healthy()
    try:
        yield srv
    finally:
        srv.stop()


def test_python_read_of_n_bytes_gives_n_until_the_end(python_server):
    reply = httpx.post(f"{python_server.url}/exact", content=pieces(10_500, 4096), timeout=30)
    assert reply.json() == {"sizes": [500, 1000], "total": 10_500}
