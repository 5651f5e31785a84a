"""The proxy holds a function's ``stream`` limits itself (gitops_sless.proxy.streamwatch):
a replica that goes quiet mid-stream, or streams past ``stream.maxSec``, is cut by the
proxy, a second after the runtime would have cut it, unfinished, with the reason logged
and the call recorded. The replicas here are small servers that enforce nothing."""

from __future__ import annotations

import asyncio
import http.client
import logging
import time
from collections.abc import Iterator

import pytest

from gitops_sless.state.routes import Route

from . import test_proxy
from .test_proxy import ProxyServer, _read_head


@pytest.fixture(scope="module")
def proxy() -> Iterator[ProxyServer]:
    server = ProxyServer("fast")
    yield server
    server.stop()


fakes = test_proxy.fakes  # the small upstream servers, on a loop of their own


async def quiet(fake, reader, writer) -> None:
    """One chunk, then nothing, with the connection open."""
    await _read_head(fake, reader)
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nfirst\n\r\n")
    await writer.drain()
    while await reader.read(65536):
        pass
    fake.eofs += 1


async def ticking(fake, reader, writer) -> None:
    """A chunk every 0.1 s, for ever."""
    await _read_head(fake, reader)
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    while True:
        writer.write(b"5\r\ntick\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)


def read_stream(proxy: ProxyServer, name: str) -> tuple[bytes, float]:
    """The body read until the connection ends, and how long that took; the response
    must end unfinished (no last chunk)."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    started = time.monotonic()
    try:
        conn.request("GET", f"/fn/prod/{name}/")
        response = conn.getresponse()
        assert response.status == 200
        with pytest.raises(http.client.IncompleteRead) as cut:
            response.read()
        return cut.value.partial, time.monotonic() - started
    finally:
        conn.close()


def test_a_stream_quiet_past_idle_sec_is_cut_by_the_proxy(proxy, fakes, caplog):
    fake = fakes.start(quiet)
    name = "quiet"
    proxy.routes.set(
        Route("prod", name, 5, (("127.0.0.1", fake.port),), stream_idle_sec=0.5, stream_max_sec=60)
    )
    try:
        with caplog.at_level(logging.INFO, logger="gitops_sless.proxy.streamwatch"):
            body, _ = read_stream(proxy, name)
        assert body == b"first\n"
        assert "prod/quiet: the stream sent nothing for 0.5s (stream.idleSec)" in caplog.text
        deadline = time.monotonic() + 5
        while fake.eofs < 1:  # the replica's connection is dropped too
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert [r.status for r in proxy.records if r.name == name] == [200]
    finally:
        proxy.routes.remove("prod", name)


def test_a_stream_past_max_sec_is_cut_by_the_proxy(proxy, fakes, caplog):
    fake = fakes.start(ticking)
    name = "long"
    proxy.routes.set(
        Route("prod", name, 5, (("127.0.0.1", fake.port),), stream_idle_sec=5, stream_max_sec=0.5)
    )
    try:
        with caplog.at_level(logging.INFO, logger="gitops_sless.proxy.streamwatch"):
            body, took = read_stream(proxy, name)
        assert body.startswith(b"tick\n") and took < 10  # cut, not the fake's for ever
        assert "prod/long: the stream ran for 0.5s (stream.maxSec)" in caplog.text
    finally:
        proxy.routes.remove("prod", name)


def test_without_a_stream_block_the_proxy_cuts_nothing(proxy, fakes):
    fake = fakes.start(quiet)
    name = "unlimited"
    proxy.routes.set(Route("prod", name, 5, (("127.0.0.1", fake.port),)))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=3)
        conn.request("GET", f"/fn/prod/{name}/")
        response = conn.getresponse()
        assert response.read(6) == b"first\n"
        with pytest.raises(TimeoutError):  # still open after the 1.5 s a limit would allow
            response.read(1)
        conn.close()
    finally:
        proxy.routes.remove("prod", name)
