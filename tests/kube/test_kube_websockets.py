"""WebSocket functions on the Kubernetes backend's proxy path (issue 30): ``serve
--backend kubernetes`` against the test API server, whose services/proxy passes an
upgrade on (as the real one does) and then echoes bytes. What the Deployment carries
(the route annotation, the runtime's environment, the grace period) makes the route a
WebSocket route after a restart too, and the proxy tunnels through the API server."""

from __future__ import annotations

import socket

from ..gitserver import WorkRepo
from ..kubeapi import FakeKube
from . import test_kube_scaling
from .test_kube_scaling import PROD, serve, wait_for

kube = test_kube_scaling.kube  # the API server with the Function resource's CRD

CHAT = {
    "chat/sless.yaml": (
        "functions:\n"
        "  - name: chat\n"
        "    runtime: python3.11\n"
        "    entrypoint: main.handler\n"
        "    timeoutSec: 10\n"
        "    stream: {drainSec: 45}\n"
        "    triggers:\n"
        "      - {type: websocket, onConnect: connect, maxMessageBytes: 4096}\n"
    ),
    "chat/main.py": "def connect(event, context):\n    pass\n\n\ndef handler(m, context):\n"
    "    return m\n",
}
KEY = b"dGhlIHNhbXBsZSBub25jZQ=="


def upgrade(server, name: str) -> tuple[socket.socket, bytes, bytes]:
    host, port = server.base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=20)
    sock.sendall(
        b"GET /fn/prod/" + name.encode() + b"/room HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: "
        + KEY
        + b"\r\n\r\n"
    )
    got = b""
    while b"\r\n\r\n" not in got:
        data = sock.recv(65536)
        assert data, got
        got += data
    head, _, rest = got.partition(b"\r\n\r\n")
    return sock, head, rest


def test_a_websocket_reaches_its_service_through_the_api_servers_proxy(kube, s3_server, tmp_path):
    repo = WorkRepo(tmp_path / "functions")
    repo.commit("chat", CHAT)
    server = serve(kube, s3_server, repo, tmp_path / "state")
    try:
        server.wait(lambda: (server.function("chat") or {}).get("phase") == "Ready", "Ready", 60)
        deployment = kube.get("Deployment", PROD, "chat")
        pod = deployment["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["SLESS_WEBSOCKET"] == "1" and env["SLESS_WS_ON_CONNECT"] == "connect"
        assert env["SLESS_WS_MAX_MESSAGE_BYTES"] == "4096"
        assert env["SLESS_STREAM_DRAIN_SEC"] == "45"
        # drainSec, then a socket's close (5 s) and onDisconnect (timeoutSec), and 5 s to exit
        assert pod["terminationGracePeriodSeconds"] == 45 + 5 + 10 + 5
        sock, head, rest = upgrade(server, "chat")
        with sock:
            assert head.startswith(b"HTTP/1.1 101 "), head
            assert b"x-service: chat" in head.lower()  # the function's Service answered
            sock.sendall(b"frames pass untouched")
            got = rest
            while len(got) < len(b"frames pass untouched"):
                got += sock.recv(65536)
            assert got == b"frames pass untouched"
        # a plain call: the function has only a websocket trigger
        assert server.call("chat", "/").status_code == 404
    finally:
        server.stop()
    assert "Traceback" not in server.output()

    again = serve(kube, s3_server, repo, tmp_path / "state-2")  # routes from the cluster
    try:
        wait_for(lambda: (again.function("chat") or {}).get("phase") == "Ready", "Ready", 60)
        sock, head, _ = upgrade(again, "chat")
        with sock:
            assert head.startswith(b"HTTP/1.1 101 "), head
    finally:
        again.stop()


def test_an_upgrade_to_a_function_without_a_websocket_trigger_is_refused(
    kube: FakeKube, s3_server, tmp_path
):
    repo = WorkRepo(tmp_path / "functions")
    plain = dict(CHAT)
    plain["chat/sless.yaml"] = plain["chat/sless.yaml"].replace(
        "      - {type: websocket, onConnect: connect, maxMessageBytes: 4096}\n",
        "      - type: http\n",
    )
    repo.commit("plain", plain)
    server = serve(kube, s3_server, repo, tmp_path / "state")
    try:
        server.wait(lambda: (server.function("chat") or {}).get("phase") == "Ready", "Ready", 60)
        sock, head, _ = upgrade(server, "chat")
        with sock:
            assert head.startswith(b"HTTP/1.1 404 "), head
        assert server.call("chat", "/").status_code == 200
    finally:
        server.stop()
