"""Replicas handed from one supervisor to the next in the same process (a restart in
place): they serve on, same processes and ports, their output still read into the log.

Both supervisors run in this test's process, as both images of ``serve`` run in one
pid: the replicas the first started are still this process's children.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gitops_sless.local.processes import Supervisor
from gitops_sless.local.units import ProcessSpec

from ..conftest import python_spec, runtimes_under

# a token made at import: the same token is the same process
HANDLER = (
    "import uuid\n"
    "TOKEN = uuid.uuid4().hex\n"
    "def main(event, context):\n"
    "    print('called with', event.get('_query', {}).get('mark'), flush=True)\n"
    "    return {'token': TOKEN}\n"
)


def _spec(artifacts: Path, env_vars: dict[str, str] | None = None) -> ProcessSpec:
    return python_spec(artifacts / "who", HANDLER, env_vars=env_vars)


class Routes:
    """What the supervisor publishes: each function's upstreams and replica key."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], tuple[tuple[tuple[str, int], ...], str]] = {}

    def __call__(self, env: str, name: str, upstreams: Any, last_exit: Any, key: str) -> None:
        self.routes[(env, name)] = (upstreams, key)

    def call(self, name: str, mark: str = "") -> list[str]:
        """Every replica of ``name`` called once, as the proxy would: their tokens."""
        upstreams, key = self.routes[("prod", name)]
        tokens = []
        for host, port in upstreams:
            conn = http.client.HTTPConnection(host, port, timeout=10)
            conn.request("GET", f"/?mark={mark}", headers={"x-sless-replica": key})
            response = conn.getresponse()
            assert response.status == 200
            tokens.append(json.loads(response.read())["token"])
            conn.close()
        return tokens


# The first supervisors, never collected: in a real restart their image is gone at exec,
# with its ``Popen`` objects; here, collected, those would warn and have ``subprocess``
# reap the processes the second supervisor adopted, behind its back.
_HANDED_OVER: list[Supervisor] = []


def _wait(predicate: Any, what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def handed_over(tmp_path: Path):
    """Two replicas of ``who`` started by one supervisor, which then hands them over."""
    routes = Routes()
    first = Supervisor(tmp_path / "state", routes)
    _HANDED_OVER.append(first)
    spec = _spec(tmp_path / "artifacts", env_vars={"SECRET_DSN": "postgres://x"})
    first.apply(spec, "hash-1", 2)
    before = sorted(routes.call("who"))
    pids = sorted(runtimes_under(tmp_path / "artifacts"))
    records = json.loads(json.dumps(first.hand_over()))  # as it travels: JSON
    supervisors: list[Supervisor] = []
    yield routes, spec, before, pids, records, supervisors
    for supervisor in supervisors:
        supervisor.close()


def test_handed_over_replicas_serve_on_in_the_same_processes_with_their_log(tmp_path, handed_over):
    routes, _, before, pids, records, supervisors = handed_over
    assert sorted(runtimes_under(tmp_path / "artifacts")) == pids  # the hand-over stops none
    assert "postgres://x" not in json.dumps(records)  # the environment stays out of it
    routes.routes.clear()

    second = Supervisor(tmp_path / "state", routes, adopt=records)
    supervisors.append(second)
    assert second.deployed("prod") == {"who": "hash-1"}
    status = second.status("prod")["who"]
    assert (status.wanted, status.ready) == (2, 2)
    # published at once: the proxy routes to them before any pass
    assert sorted(routes.call("who", mark="after-adoption")) == before
    assert sorted(runtimes_under(tmp_path / "artifacts")) == pids
    log = tmp_path / "state" / "logs" / "prod" / "who.log"
    _wait(lambda: log.read_text().count("called with after-adoption") == 2, "the log lines")

    second.close()  # and the next stop stops them, as any replica
    assert runtimes_under(tmp_path / "artifacts") == []


def test_an_adopted_replica_that_ends_is_restarted_only_once_its_spec_is_known(
    tmp_path, handed_over
):
    routes, spec, _, pids, records, supervisors = handed_over
    second = Supervisor(tmp_path / "state", routes, adopt=records)
    supervisors.append(second)
    os.kill(pids[0], signal.SIGKILL)
    _wait(lambda: second.status("prod")["who"].ready == 1, "the replica to leave")
    time.sleep(1.5)  # past the first restart's backoff: it would have started by now
    assert second.status("prod")["who"].ready == 1  # no environment to start it with

    assert not second.adopt_spec(spec, "hash-2")  # not what runs: the pass replaces it
    assert second.adopt_spec(spec, "hash-1")
    _wait(lambda: second.status("prod")["who"].ready == 2, "the restart")
    assert len(set(routes.call("who"))) == 2


def test_a_record_this_image_cannot_use_leaves_no_process_behind(tmp_path, handed_over, caplog):
    routes, _, _, _, records, supervisors = handed_over
    records[0]["spec"]["runtime"] = "cobol85"  # a runtime the next version dropped
    with caplog.at_level(logging.WARNING, logger="gitops_sless.local.adoption"):
        second = Supervisor(tmp_path / "state", routes, adopt=records)
    assert "a replica record from before the restart is unusable" in caplog.text
    assert "cobol85" in caplog.text
    supervisors.append(second)
    assert second.deployed("prod") == {}
    # stopped as any orphan: the restore then starts the function again
    _wait(lambda: runtimes_under(tmp_path / "artifacts") == [], "the orphans to stop")


def test_without_a_hand_over_a_new_supervisor_stops_what_an_earlier_one_left(tmp_path):
    routes = Routes()
    first = Supervisor(tmp_path / "state", routes)
    _HANDED_OVER.append(first)
    first.apply(_spec(tmp_path / "artifacts"), "hash-1", 1)
    assert runtimes_under(tmp_path / "artifacts")
    first.hand_over()  # the next image never came (exec failed): nobody adopts them
    second = Supervisor(tmp_path / "state", routes)
    try:
        assert second.deployed("prod") == {}
        _wait(lambda: runtimes_under(tmp_path / "artifacts") == [], "the orphans to stop")
    finally:
        second.close()
