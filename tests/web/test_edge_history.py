"""End to end, from an anonymous client: the history and the log cannot be flooded.

Against a real ``serve`` over loopback: calls to names nobody declares are
only counted, long paths are cut before they are stored, a flood on one
function never evicts another's history, a client that leaves mid-body is
one quiet event, and a signed but malformed webhook is 400, never 500.
"""

from __future__ import annotations

import json
import socket

import pytest

from .. import gitserver
from ..test_serve import _github, http_function, setup

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve


def _history(server, name: str) -> list[dict]:
    return server.function(name)["invocations"]


def test_unknown_names_and_long_paths_cannot_fill_the_disk_or_evict_history(setup):
    setup.push({**http_function("quiet", "q"), **http_function("busy", "b")})
    server = setup.serve()
    assert server.call("quiet", "/kept").status_code == 200
    server.wait(lambda: _history(server, "quiet"), "the call to be recorded", timeout=10)
    database = setup.tmp_path / "state" / "status.db"

    client = server.client
    for _ in range(600):
        assert client.get("/fn/prod/nope/").status_code == 404
    long_path = "/" + "x" * (48 * 1024)
    for _ in range(25):
        assert client.get(f"/fn/prod/busy{long_path}").status_code == 200
    for i in range(600):
        client.get(f"/fn/prod/busy/{i}")

    def flushed():
        calls = _history(server, "busy")
        return calls and calls[0]["path"] == "/599" and calls

    server.wait(flushed, "the flood to be recorded", timeout=20)
    size = sum(p.stat().st_size for p in database.parent.glob("status.db*"))
    assert size < 8 << 20, f"the status database grew to {size} bytes"
    detail = server.client.get("/api/v1/environments/prod/functions/busy").text
    assert len(detail) < 200_000
    assert [c["path"] for c in _history(server, "quiet")] == ["/kept"]  # not evicted
    assert server.function("nope") is None
    metrics = server.client.get("/metrics").text
    assert "sless_proxy_unknown_total 600" in metrics


def test_long_paths_are_stored_cut_and_marked(setup):
    setup.push(http_function("long", "l"))
    server = setup.serve()
    server.call("long", "/" + "y" * 5000 + "?q=" + "z" * 5000)
    call = server.wait(lambda: _history(server, "long"), "the call to be recorded", timeout=10)[0]
    assert call["pathTruncated"] is True
    assert len(call["path"].encode()) <= 256 and call["path"].startswith("/yyy")


def test_a_client_that_leaves_mid_body_is_no_traceback(setup):
    setup.push(http_function("stay", "s"))
    server = setup.serve()
    for path in ("/api/v1/webhooks/github", "/api/v1/webhooks/gitea", "/fn/prod/stay/"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                "Content-Type: application/json\r\n\r\n0123456789".encode()
            )
    assert server.call("stay").status_code == 200
    server.stop()
    output = server.output()
    assert "Traceback" not in output and "ClientDisconnect" not in output, output[-3000:]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" * 10_000 + b"]" * 10_000, id="nested-10000"),
        pytest.param(b'{"ref": 5}', id="ref-number"),
        pytest.param(b'{"ref": null}', id="ref-null"),
        pytest.param(b'"refs/heads/main"', id="not-an-object"),
        pytest.param(b"{}", id="no-ref"),
        pytest.param(b"\xff\xfe", id="not-json"),
    ],
)
def test_a_signed_but_malformed_webhook_is_400_with_the_reason(setup, body):
    setup.push(http_function("hooked", "h"))
    server = setup.serve()
    passes = len(server.syncs())
    response = server.client.post("/api/v1/webhooks/github", content=body, headers=_github(body))
    assert response.status_code == 400, response.text
    assert response.json()["error"]
    assert len(server.syncs()) == passes
    ok = json.dumps({"ref": "refs/heads/main"}).encode()
    assert (
        server.client.post("/api/v1/webhooks/github", content=ok, headers=_github(ok)).status_code
        == 202
    )
