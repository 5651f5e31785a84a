"""Stopping ``serve`` at any moment leaves no process behind.

End to end with a real ``gitops-sless serve`` (SIGTERM while the first pass of a
restart is starting replicas, or while a job runs), and in process with the
supervisor (``close`` racing ``apply``, a job run, a restart).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gitops_sless.local.processes import Supervisor
from gitops_sless.plan.backend import ApplyFailed, JobFailed

from . import gitserver
from .conftest import processes_under, python_spec, runtimes_under
from .gitserver import GitDaemon
from .sless_server import ServedRepo, SlessServer

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon


def _function(name: str, replicas: int = 2) -> dict[str, str]:
    return {
        f"{name}/handler.py": f"def main(event):\n    return {{'name': {name!r}}}\n",
        f"{name}/sless.yaml": (
            "functions:\n"
            f"  - name: {name}\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.main\n"
            f"    replicas: {replicas}\n"
            "    triggers: [{type: http}]\n"
        ),
    }


@pytest.fixture
def repo(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[ServedRepo]:
    served = ServedRepo(tmp_path, git_daemon, git_root)
    yield served
    served.close()


def _sigterm_and_wait(server: SlessServer) -> None:
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"serve did not exit on SIGTERM:\n{server.output()}") from None


FUNCTIONS = ("alpha", "beta", "gamma", "delta")


def test_sigterm_during_the_first_pass_of_a_restart_leaves_no_process(repo):
    files: dict[str, str] = {}
    for name in FUNCTIONS:
        files.update(_function(name))
    repo.push(files)
    first = repo.server().start()  # builds everything; later starts only start replicas
    for name in FUNCTIONS:
        assert first.function(name)["phase"] == "Ready", first.output()
    artifacts = repo.state / "artifacts"
    first.wait(lambda: len(runtimes_under(artifacts)) == 2 * len(FUNCTIONS), "8 replicas")
    _sigterm_and_wait(first)
    assert processes_under(repo.state) == []

    for delay in (0.0, 0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8):
        server = repo.server().start(wait_for_sync=False)  # returns once /healthz answers
        time.sleep(delay)
        _sigterm_and_wait(server)
        left = processes_under(repo.state)
        assert left == [], f"{len(left)} processes left after SIGTERM at +{delay}s"

    last = repo.server().start()  # and the state folder still serves after all that
    for name in FUNCTIONS:
        last.wait(lambda name=name: last.call(name).status_code == 200, f"{name} to answer")
        assert last.call(name).json() == {"name": name}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_asked_for_by_a_signal_exits_zero(repo, sig):
    """As the exit-code table says: uvicorn would end the process by the signal (143, 130)."""
    repo.push(_function("alpha", replicas=1))
    server = repo.server().start()
    assert server.process is not None
    server.process.send_signal(sig)
    assert server.process.wait(30) == 0, server.output()[-2000:]
    assert "server.stopped" in server.output()
    assert processes_under(repo.state) == []


def test_sigterm_while_a_job_runs_stops_the_job(repo, tmp_path):
    repo.push(
        {
            "slow/handler.py": (
                "import time\ndef run(event):\n    time.sleep(120)\n    return {}\n"
            ),
            "slow/sless.yaml": (
                "functions:\n"
                "  - name: slow\n"
                "    runtime: python3.11\n"
                "    entrypoint: handler.run\n"
                "    timeoutSec: 300\n"
                "    jobs: [{name: forever, runId: 1, event: {}}]\n"
            ),
        }
    )
    server = repo.server().start(wait_for_sync=False)
    # its sandbox lets the job write nothing the test could see: its process is the sign
    server.wait(lambda: processes_under(repo.state), "the job to start")
    _sigterm_and_wait(server)  # within its 30 s: a serve that waited for the job's 120 s fails
    assert processes_under(repo.state) == []


# ----------------------------------------------------------------------------- in process

HANDLER = "def main(event, context):\n    return {'ok': True}\n"
SLOW_IMPORT = "import time\ntime.sleep(0.4)\n" + HANDLER


def _spec(folder: Path, name: str, source: str = HANDLER, entrypoint: str = "handler.main"):
    return python_spec(folder, source, name=name, entrypoint=entrypoint)


@pytest.mark.parametrize("delay", [0.0, 0.1, 0.3, 0.6, 1.0])
def test_close_racing_apply_leaves_no_process(tmp_path, delay):
    published: list[tuple[str, str, int]] = []
    supervisor = Supervisor(
        tmp_path / "state", lambda env, name, ups, *_: published.append((env, name, len(ups)))
    )
    artifacts = tmp_path / "artifacts"
    spec = _spec(artifacts / "slow", "slow", SLOW_IMPORT)
    outcome: list[object] = []

    def apply() -> None:
        try:
            supervisor.apply(spec, "hash", 3)
            outcome.append("applied")
        except ApplyFailed as exc:
            outcome.append(exc)

    thread = threading.Thread(target=apply)
    thread.start()
    time.sleep(delay)
    supervisor.close()
    assert processes_under(artifacts) == []
    thread.join(30)
    assert not thread.is_alive()
    assert processes_under(artifacts) == []  # and nothing started after close returned
    if outcome != ["applied"]:
        assert "shutting down" in str(outcome[0])
    with pytest.raises(ApplyFailed, match="shutting down"):
        supervisor.apply(spec, "hash", 1)
    assert processes_under(artifacts) == []


def test_close_stops_a_running_job(tmp_path):
    supervisor = Supervisor(tmp_path / "state", lambda *_: None)
    marker = tmp_path / "job-started"
    source = (
        "import time\n"
        "def run(event):\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    time.sleep(120)\n"
        "    return {}\n"
    )
    spec = _spec(tmp_path / "artifacts" / "job", "job", source, "handler.run")
    failure: list[BaseException] = []

    def run() -> None:
        try:
            supervisor.run_once(spec, {}, 300)
        except JobFailed as exc:
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 20
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists()
    supervisor.close()
    thread.join(20)
    assert not thread.is_alive()
    assert failure and "interrupted by shutdown" in str(failure[0])
    assert processes_under(tmp_path / "artifacts") == []
    with pytest.raises(JobFailed, match="shutting down"):
        supervisor.run_once(spec, {}, 5)


def test_close_during_a_restart_leaves_no_process(tmp_path):
    supervisor = Supervisor(tmp_path / "state", lambda *_: None)
    artifacts = tmp_path / "artifacts"
    spec = _spec(artifacts / "crashy", "crashy", SLOW_IMPORT)
    supervisor.apply(spec, "hash", 1)
    (replica,) = processes_under(artifacts)
    os.kill(replica, signal.SIGKILL)
    # the restart spawns a new replica within the first backoff (0.5 s), which then
    # spends 0.4 s importing: close while it does
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and processes_under(artifacts) in ([], [replica]):
        time.sleep(0.01)
    supervisor.close()
    time.sleep(0.5)
    assert processes_under(artifacts) == []


def test_the_helper_sees_a_process_in_the_folder(tmp_path):
    # the assertions above mean something only if a process there is found
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 5
        while proc.pid not in processes_under(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.pid in processes_under(tmp_path)
    finally:
        proc.kill()
        proc.wait()
    assert proc.pid not in processes_under(tmp_path)
