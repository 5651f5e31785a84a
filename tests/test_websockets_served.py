"""WebSocket functions through ``/fn/`` (issue 30): a real ``gitops-sless serve`` on the
local backend, real runtimes in the sandbox, and a real client (the ``websockets``
package). The proxy passes the upgrade and then the bytes; an open socket is load (its
replica is not scaled to zero); a deploy lets open sockets drain on the old code for
``stream.drainSec`` while new sockets reach the new code, then closes them with 1001."""

from __future__ import annotations

import time

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from .test_serve import git_daemon, git_root, setup  # noqa: F401

PYTHON = """\
VERSION = "{version}"


def connect(event, context):
    if "deny" in event["_query"]:
        return {{"statusCode": 403, "body": {{"error": "denied"}}}}


def handler(message, context):
    if message == "push":
        context.send("pushed")
    return VERSION + ": " + message
"""
NODE = """\
const VERSION = "{version}";

exports.connect = async (event) => {{
  if ("deny" in event._query) return {{ statusCode: 403, body: {{ error: "denied" }} }};
}};

exports.handler = async (message, context) => {{
  if (message === "push") await context.send("pushed");
  return `${{VERSION}}: ${{message}}`;
}};
"""
CODE = {"python3.11": ("chat.py", PYTHON), "nodejs20": ("chat.js", NODE)}
RUNTIMES = pytest.mark.parametrize("runtime", sorted(CODE))


def chat(runtime: str, version: str, extra: str = "") -> dict[str, str]:
    name, code = CODE[runtime]
    manifest = (
        "functions:\n"
        "  - name: chat\n"
        f"    runtime: {runtime}\n"
        "    entrypoint: chat.handler\n"
        "    triggers:\n"
        "      - {type: websocket, onConnect: connect}\n" + extra
    )
    return {"chat/sless.yaml": manifest, f"chat/{name}": code.format(version=version)}


def open_socket(served, query: str = "") -> ClientConnection:
    url = served.base.replace("http://", "ws://") + "/fn/prod/chat/" + query
    return connect(url, open_timeout=30, close_timeout=5)


def ask(ws: ClientConnection, message: str) -> str:
    ws.send(message)
    return str(ws.recv(timeout=10))


@RUNTIMES
def test_a_socket_through_fn_answers_pushes_and_can_be_refused(setup, runtime):  # noqa: F811
    setup.push(chat(runtime, "v1"))
    served = setup.serve()
    with open_socket(served) as ws:
        assert ask(ws, "hi") == "v1: hi"
        ws.send("push")
        assert [ws.recv(timeout=10), ws.recv(timeout=10)] == ["pushed", "v1: push"]
    with pytest.raises(InvalidStatus) as refused:
        open_socket(served, "?deny=1")
    assert refused.value.response.status_code == 403
    assert b'"denied"' in refused.value.response.body
    # only a websocket trigger: a plain call is not the handler's, nor an asynchronous one
    assert served.call("chat", "/").status_code == 404
    queued = served.client.post("/fn/prod/chat/", content=b"x", headers={"Prefer": "respond-async"})
    assert queued.status_code == 404, queued.text


@RUNTIMES
def test_a_deploy_drains_an_open_socket_while_new_sockets_reach_the_new_code(
    setup,  # noqa: F811
    runtime,
):
    drain = "    stream: {drainSec: 8}\n"
    setup.push(chat(runtime, "v1", drain))
    served = setup.serve()
    with open_socket(served) as old:
        assert ask(old, "before") == "v1: before"
        setup.push(chat(runtime, "v2", drain), "v2")
        served.sync()

        def new_code() -> bool:
            with open_socket(served) as ws:
                return ask(ws, "probe") == "v2: probe"

        served.wait(new_code, "a new socket to reach v2")
        # the socket opened before the deploy still runs on the old code meanwhile
        assert ask(old, "during") == "v1: during"
        with pytest.raises(ConnectionClosed) as closed:  # then it is closed, going away
            old.recv(timeout=60)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001


def test_an_open_socket_keeps_its_replica_from_scaling_to_zero(setup):  # noqa: F811
    setup.push(chat("python3.11", "v1", "    scale: {min: 0, max: 1, idle: 1s}\n"))
    served = setup.serve()
    with open_socket(served) as ws:
        assert ask(ws, "one") == "v1: one"
        time.sleep(4)  # idle is 1 s: without the socket counted, its replica would stop
        assert served.function("chat")["phase"] == "Ready"
        assert served.function("chat")["openSockets"] == 1
        assert ask(ws, "two") == "v1: two"
    served.wait(lambda: served.function("chat")["phase"] == "Idle", "chat to scale to zero")
    assert served.function("chat")["openSockets"] == 0
    detail = served.client.get("/api/v1/environments/prod/functions/chat").json()
    (socket,) = [c for c in detail["invocations"] if c["status"] == 101]
    assert socket["bytes"] >= len(b"v1: onev1: two") and socket["chunks"] is None
    assert socket["durationMs"] >= 4000  # a socket's call lasts as long as it was open
