"""Streamed responses through ``/fn/`` (issue 30): a real ``gitops-sless serve`` on the
local backend, real runtimes in the sandbox. The proxy passes each chunk on as it comes,
ends a stream the function left unfinished unfinished too, closes the function's stream
when its caller goes away, and enforces the manifest's ``stream`` limits itself."""

from __future__ import annotations

import socket

import httpx
import pytest

from .test_serve import git_daemon, git_root, setup  # noqa: F401

# /first-then-wait yields, then waits until a call to /release (the same process);
# the iteration's end is printed, to be read in the function's log
PYTHON = """\
import threading, time

released = threading.Event()

def main(event, context):
    path = event["_path"]
    if path == "/release":
        released.set()
        return {"released": True}
    if path == "/first-then-wait":
        def values():
            yield "first\\n"
            released.wait(30)
            yield "second\\n"
        return values()
    if path == "/boom":
        def values():
            yield "first\\n"
            raise RuntimeError("broke mid-stream")
        return values()
    if path == "/counting":
        def values():
            try:
                for n in range(2000):
                    yield f"tick {n}\\n"
                    time.sleep(0.05)
            finally:
                print("the iteration ended", flush=True)
        return values()
    if path == "/quiet":
        def values():
            yield "first\\n"
            time.sleep(float(event["_query"].get("sleep", "5")))
            yield "late\\n"
        return values()
    return {"path": path}
"""
NODE = """\
let release;
const released = new Promise((resolve) => { release = resolve; });

exports.main = async (event, context) => {
  if (event._path === "/release") {
    release();
    return { released: true };
  }
  if (event._path === "/first-then-wait") {
    return (async function* () {
      yield "first\\n";
      await released;
      yield "second\\n";
    })();
  }
  if (event._path === "/counting") {
    return (async function* () {
      try {
        for (let n = 0; n < 2000; n++) {
          yield `tick ${n}\\n`;
          await new Promise((resolve) => setTimeout(resolve, 50));
        }
      } finally {
        console.log("the iteration ended");
      }
    })();
  }
  return { path: event._path };
};
"""
CODE = {"python3.11": ("handler.py", PYTHON), "nodejs20": ("handler.js", NODE)}
RUNTIMES = pytest.mark.parametrize("runtime", sorted(CODE))


def manifest(extra: str = "", runtime: str = "python3.11") -> str:
    return (
        "functions:\n"
        "  - name: ticker\n"
        f"    runtime: {runtime}\n"
        "    entrypoint: handler.main\n"
        "    triggers: [{type: http}]\n" + extra
    )


@pytest.fixture
def served(setup):  # noqa: F811
    setup.push({"ticker/sless.yaml": manifest(), "ticker/handler.py": PYTHON})
    return setup.serve()


def serve(setup, runtime: str):  # noqa: F811
    name, code = CODE[runtime]
    setup.push({"ticker/sless.yaml": manifest(runtime=runtime), f"ticker/{name}": code})
    return setup.serve()


@RUNTIMES
def test_each_chunk_passes_the_proxy_as_it_comes(setup, runtime):  # noqa: F811
    served = serve(setup, runtime)
    with served.client.stream("GET", "/fn/prod/ticker/first-then-wait") as response:
        assert response.status_code == 200
        assert response.headers["transfer-encoding"] == "chunked"
        assert "x-request-id" in response.headers
        chunks = response.iter_raw()
        assert next(chunks) == b"first\n"  # buffered by the proxy, this would hang
        assert served.call("ticker", "/release").json() == {"released": True}
        assert b"".join(chunks) == b"second\n"


def test_a_stream_the_function_left_unfinished_is_unfinished_for_the_caller(served):
    with (
        pytest.raises(httpx.RemoteProtocolError),
        served.client.stream("GET", "/fn/prod/ticker/boom") as response,
    ):
        b"".join(response.iter_raw())
    log = served.state_dir / "logs" / "prod" / "ticker.log"
    served.wait(lambda: "broke mid-stream" in log.read_text(), "the traceback in the log")


@RUNTIMES
def test_a_caller_that_goes_away_ends_the_functions_iteration(setup, runtime):  # noqa: F811
    served = serve(setup, runtime)
    log = served.state_dir / "logs" / "prod" / "ticker.log"
    host, port = served.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /fn/prod/ticker/counting HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b"tick 1\n" not in got:
            got += sock.recv(65536)
    # the whole stream would take 100 s: its end within seconds is the caller's leaving
    served.wait(lambda: "the iteration ended" in log.read_text(), "the iteration's end", 15)


def test_the_manifests_idle_limit_ends_a_quiet_stream(setup):  # noqa: F811
    quiet = "    stream: {idleSec: 1}\n"
    setup.push({"ticker/sless.yaml": manifest(quiet), "ticker/handler.py": PYTHON})
    served = setup.serve()
    got = b""
    with (
        pytest.raises(httpx.RemoteProtocolError),
        served.client.stream("GET", "/fn/prod/ticker/quiet", params={"sleep": "8"}) as r,
    ):
        for chunk in r.iter_raw():
            got += chunk
    assert got == b"first\n"
    log = served.state_dir / "logs" / "prod" / "ticker.log"
    served.wait(lambda: "sent nothing for 1s (stream.idleSec)" in log.read_text(), "the reason")


def test_an_open_stream_shows_in_the_status_metrics_and_dashboard_then_in_the_history(served):
    def shown() -> dict:
        return served.client.get("/api/v1/environments/prod/functions/ticker").json()

    def metric() -> str:
        lines = served.client.get("/metrics").text.splitlines()
        mine = 'sless_open_connections{env="prod",function="ticker",kind="stream"}'
        return next((line.split()[-1] for line in lines if line.startswith(mine)), "none")

    with served.client.stream("GET", "/fn/prod/ticker/first-then-wait") as response:
        chunks = response.iter_raw()
        assert next(chunks) == b"first\n"
        assert shown()["openStreams"] == 1 and shown()["openSockets"] == 0
        assert metric() == "1"
        assert "1 stream" in served.client.get("/functions/prod/ticker").text
        assert served.call("ticker", "/release").status_code == 200
        assert b"".join(chunks) == b"second\n"
    served.wait(lambda: shown()["openStreams"] == 0, "the stream to be closed")
    assert metric() == "0"

    def recorded() -> dict | None:
        calls = shown()["invocations"]
        return next((c for c in calls if c["path"] == "/first-then-wait"), None)

    call = served.wait(recorded, "the stream in the history")
    assert call["bytes"] == len(b"first\nsecond\n") and call["chunks"] == 2
    plain = served.wait(
        lambda: next((c for c in shown()["invocations"] if c["path"] == "/release"), None),
        "the plain call",
    )
    assert plain["bytes"] is None and plain["chunks"] is None


DRAINING = """\
import time

def main(event, context):
    if event["_path"] == "/slow":
        def values():
            yield "{version} first\\n"
            time.sleep(3)
            yield "{version} last\\n"
        return values()
    return {{"version": "{version}"}}
"""


def test_a_deploy_lets_an_open_stream_finish_on_the_old_code(setup):  # noqa: F811
    drain = "    stream: {drainSec: 20}\n"
    setup.push(
        {"ticker/sless.yaml": manifest(drain), "ticker/handler.py": DRAINING.format(version="v1")}
    )
    served = setup.serve()
    with served.client.stream("GET", "/fn/prod/ticker/slow") as response:
        chunks = response.iter_raw()
        assert next(chunks) == b"v1 first\n"
        setup.push({"ticker/handler.py": DRAINING.format(version="v2")}, "v2")
        served.sync()
        # new calls reach the new code at once, while the old stream goes on
        served.wait(lambda: served.call("ticker", "/").json()["version"] == "v2", "v2")
        assert b"".join(chunks) == b"v1 last\n"  # whole: drained, not cut
