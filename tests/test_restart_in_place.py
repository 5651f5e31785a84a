"""Restarting ``serve`` costs callers nothing (SIGUSR2: a restart in place), and a stopped
server holds calls while it starts each function's last good version again.

End to end with a real ``gitops-sless serve``, real runtimes in bubblewrap and callers
that each open a connection of their own, as many clients do.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gitops_sless.serve import restart

from . import gitserver
from .conftest import processes_under, runtimes_under
from .gitserver import GitDaemon
from .sless_server import ServedRepo, SlessServer

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon

# a token made when the module loads: the same token is the same process
PY_HANDLER = (
    "import time, uuid\n"
    "TOKEN = uuid.uuid4().hex\n"
    "time.sleep({delay})\n"
    "def main(event, context):\n"
    "    print('called with', event['_query'].get('mark'), flush=True)\n"
    "    return {{'token': TOKEN, 'version': {version!r}}}\n"
)
JS_HANDLER = (
    "const TOKEN = require('crypto').randomUUID();\n"
    "module.exports.main = async () => ({ token: TOKEN });\n"
)


def _python(name: str, version: str = "v1", delay: float = 0) -> dict[str, str]:
    return {
        f"{name}/handler.py": PY_HANDLER.format(delay=delay, version=version),
        f"{name}/sless.yaml": (
            "functions:\n"
            f"  - name: {name}\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.main\n"
            "    replicas: 2\n"
            "    triggers: [{type: http}]\n"
        ),
    }


def _node(name: str) -> dict[str, str]:
    return {
        f"{name}/handler.js": JS_HANDLER,
        f"{name}/sless.yaml": (
            "functions:\n"
            f"  - name: {name}\n"
            "    runtime: nodejs20\n"
            "    entrypoint: handler.main\n"
            "    triggers: [{type: http}]\n"
        ),
    }


@pytest.fixture
def repo(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[ServedRepo]:
    served = ServedRepo(tmp_path, git_daemon, git_root)
    yield served
    served.close()


def _call(port: int, name: str, mark: str = "") -> tuple[int | str, dict]:
    """One call on a connection of its own: (status, body), or ("refused" ...) and why."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", f"/fn/prod/{name}/?mark={mark}", headers={"Connection": "close"})
        response = conn.getresponse()
        body = response.read()
        return response.status, json.loads(body) if response.status == 200 else {"body": body}
    except OSError as exc:
        return "failed", {"error": repr(exc)}
    finally:
        conn.close()


class Load:
    """Callers that call each function over and over until stopped."""

    def __init__(self, port: int, names: list[str]) -> None:
        self.results: list[tuple[str, float, int | str, dict]] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(port, name), daemon=True) for name in names
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, port: int, name: str) -> None:
        while not self._stop.is_set():
            status, body = _call(port, name)
            self.results.append((name, time.monotonic(), status, body))

    def stop(self) -> list[tuple[str, float, int | str, dict]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)
        return self.results


def _restart(server: SlessServer) -> None:
    """SIGUSR2, then wait for the new image's first pass."""
    assert server.process is not None
    server.process.send_signal(signal.SIGUSR2)

    def first_pass() -> bool:
        _, restarting, after = server.output().partition("server.restarting")
        return bool(restarting) and "sync.finished" in after

    server.wait(first_pass, "the new image's first pass")


def test_a_restart_in_place_under_load_answers_every_call_from_the_same_replicas(repo):
    repo.push({**_python("py"), **_node("js")})
    server = repo.server().start()
    artifacts = repo.state / "artifacts"
    server.wait(lambda: len(runtimes_under(artifacts)) == 3, "three replicas")
    replicas = sorted(runtimes_under(artifacts))
    tokens = {
        name: {_call(server.port, name)[1]["token"] for _ in range(8)} for name in ("py", "js")
    }
    assert len(tokens["py"]) == 2 and len(tokens["js"]) == 1
    pid = server.process.pid if server.process else 0

    load = Load(server.port, ["py", "js", "py"])
    server.wait(lambda: len(load.results) > 50, "calls under way")
    _restart(server)
    count = len(load.results)
    server.wait(lambda: len(load.results) > count + 50, "calls after the restart")
    results = load.stop()

    failed = [(name, status, body) for name, _, status, body in results if status != 200]
    assert failed == [], f"{len(failed)} of {len(results)} calls not answered 200: {failed[:5]}"
    assert server.process is not None and server.process.poll() is None
    assert server.process.pid == pid  # in place: a service manager sees one process
    for name in ("py", "js"):  # the same processes answered before, during and after
        assert {body["token"] for n, _, _, body in results if n == name} == tokens[name]
    assert sorted(runtimes_under(artifacts)) == replicas
    output = server.output()
    assert output.count("replica.adopted") == 2

    # their output is still read into the function's log
    assert _call(server.port, "py", mark="after-the-restart")[0] == 200
    logs = "/api/v1/environments/prod/functions/py/logs"
    server.wait(lambda: "called with after-the-restart" in server.client.get(logs).text, "the log")
    assert server.function("py")["phase"] == "Ready"

    server.stop()  # a stop still stops every replica, adopted or not
    assert processes_under(repo.state) == []


def test_a_version_pushed_before_the_restart_replaces_the_adopted_replicas(repo):
    repo.push(_python("py"))
    server = repo.server().start()
    artifacts = repo.state / "artifacts"
    server.wait(lambda: len(runtimes_under(artifacts)) == 2, "two replicas")
    old = set(runtimes_under(artifacts))
    repo.push(_python("py", version="v2"))  # not fetched yet: the poll interval is an hour
    _restart(server)
    server.wait(lambda: _call(server.port, "py")[1].get("version") == "v2", "the new version")
    server.wait(lambda: not old & set(runtimes_under(artifacts)), "the old replicas to stop")
    assert len(runtimes_under(artifacts)) == 2
    server.stop()
    assert processes_under(repo.state) == []


def test_a_stopped_server_holds_calls_while_it_starts_the_last_good_version(repo):
    repo.push(_python("slow", delay=3))  # three seconds to import: a start the call sees
    first = repo.server().start()
    assert _call(first.port, "slow")[0] == 200
    first.stop()
    assert processes_under(repo.state) == []

    # returns once /healthz answers: the restore is still importing the handler then
    second = repo.server().start(wait_for_sync=False)
    status, body = _call(second.port, "slow")
    # it waited for the start instead of a 503 ("not ready": no replica yet)
    assert status == 200, body
    assert body["version"] == "v1"
    assert "function.restored" in second.output()


def test_a_restart_asked_for_while_serve_starts_never_ends_it(repo):
    repo.push(_python("py"))
    server = repo.server()
    env = {**os.environ}
    env.pop("SLESS_API_TOKEN", None)
    with server.log.open("ab") as out:
        server.process = subprocess.Popen(
            server.command(), stdout=out, stderr=subprocess.STDOUT, env=env
        )
    # its first line is written once the command line is read, before the server exists
    server.wait(lambda: "sandbox.bubblewrap" in server.output(), "serve to begin")
    server.process.send_signal(signal.SIGUSR2)  # SIGUSR2's default action ends a process
    server.wait(lambda: _call(server.port, "py")[0] == 200, "py to answer")
    assert server.process.poll() is None, server.output()


def test_restarts_asked_for_one_after_another_never_end_serve(repo):
    repo.push(_python("py"))
    server = repo.server().start()
    assert server.process is not None
    server.process.send_signal(signal.SIGUSR2)
    # the next one while the new image loads: SIGUSR2's default action ends a process
    server.wait(lambda: "server.restarting" in server.output(), "the restart")
    server.process.send_signal(signal.SIGUSR2)
    server.wait(lambda: _call(server.port, "py")[0] == 200, "py to answer")
    assert server.process.poll() is None, server.output()[-3000:]
    server.stop()
    assert processes_under(repo.state) == []


PROBE = (
    "import os, socket\n"
    "def main(event, context):\n"
    "    port = int(event['_query']['port'])\n"
    "    found = []\n"
    "    for fd in os.listdir('/proc/self/fd'):\n"
    "        try:\n"
    "            target = os.readlink(f'/proc/self/fd/{fd}')\n"
    "        except OSError:\n"
    "            continue\n"
    "        if 'memfd' in target:\n"
    "            found.append(target)\n"
    "        elif target.startswith('socket:'):\n"
    "            s = socket.socket(fileno=os.dup(int(fd)))\n"
    "            try:\n"
    "                if s.getsockname()[1:2] == (port,):\n"
    "                    found.append(f'the server socket on {port}')\n"
    "            except OSError:\n"
    "                pass\n"
    "            finally:\n"
    "                s.close()\n"
    "    return {'found': found, 'looked': len(os.listdir('/proc/self/fd'))}\n"
)


def test_a_function_finds_neither_the_servers_sockets_nor_the_hand_over(repo):
    """What a function would look for to take the server's port over or to read the replica
    keys handed over: every descriptor it holds, before and after a restart in place."""
    repo.push(
        {
            "probe/handler.py": PROBE,
            "probe/sless.yaml": (
                "functions:\n  - name: probe\n    runtime: python3.11\n"
                "    entrypoint: handler.main\n    triggers: [{type: http}]\n"
            ),
        }
    )
    server = repo.server().start()
    for _ in range(2):
        status, body = _call(server.port, "probe", mark=f"x&port={server.port}")
        assert status == 200 and body["looked"] > 0, body
        assert body["found"] == [], body
        _restart(server)


def test_an_unreadable_hand_over_is_said_and_adopts_nothing(monkeypatch, caplog):
    fd = os.memfd_create("sless-handoff", 0)
    os.write(fd, b"{not json")
    os.lseek(fd, 0, os.SEEK_SET)
    monkeypatch.setenv(restart.HANDOFF_ENV, str(fd))
    with caplog.at_level(logging.WARNING, logger=restart.log.name):
        assert restart.take_handoff() is None
    assert "the state handed over by the previous image is unreadable" in caplog.text
    assert restart.HANDOFF_ENV not in os.environ  # never read twice


def test_a_restart_that_cannot_execute_says_why_and_exits_one(monkeypatch, caplog):
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        server = restart.Restart()

        def refused(*args: object) -> None:
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(restart.os, "execve", refused)
        with (
            caplog.at_level(logging.ERROR, logger=restart.log.name),
            pytest.raises(SystemExit) as exited,
        ):
            server.exec(None)
        assert exited.value.code == 1
        assert "cannot re-execute" in caplog.text and "Permission denied" in caplog.text
    finally:
        signal.signal(signal.SIGUSR2, previous)


def _scaled(name: str) -> dict[str, str]:
    """A python function that scales to zero after a second without calls, with a
    concurrency limit of 1 and a body limit of 64 bytes (what its route enforces)."""
    return {
        f"{name}/handler.py": PY_HANDLER.format(delay=0, version="v1"),
        f"{name}/sless.yaml": (
            "functions:\n"
            f"  - name: {name}\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.main\n"
            "    scale: {min: 0, max: 2, idle: 1s}\n"
            "    maxBodyBytes: 64\n"
            "    triggers: [{type: http}]\n"
        ),
    }


def _post(port: int, name: str, body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", f"/fn/prod/{name}/", body=body, headers={"Connection": "close"})
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.parametrize("how", ["in place", "stop and start"])
def test_a_restart_keeps_the_policies_of_a_function_it_serves_again(repo, how):
    # what serves is written down when it starts; a restart serves it from that record,
    # and the record must carry every policy of the function, not only its code
    repo.push(_scaled("lazy"))
    server = repo.server().start()
    status, body = _call(server.port, "lazy")
    assert status == 200, body
    server.wait(lambda: server.function("lazy")["phase"] == "Idle", "lazy to go idle")
    if how == "in place":
        _restart(server)
    else:
        server.stop()
        server = repo.server().start()
    server.wait(lambda: server.function("lazy")["phase"] == "Idle", "lazy idle again")
    # woken by a call, as before the restart (a fixed count of 0 would answer 503)
    status, body = _call(server.port, "lazy")
    assert status == 200, body
    assert _post(server.port, "lazy", b"x" * 65) == 413  # its own body limit still holds
    server.wait(lambda: server.function("lazy")["phase"] == "Idle", "lazy to go idle again")
    server.stop()
