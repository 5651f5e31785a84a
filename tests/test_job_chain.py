"""A job's result handed on to the functions that name it (``env: {X: {job: NAME}}``).

A push that changes the code of a folder holding a job and its dependent, and
bumps the job's ``runId``, replaces the dependent once: with the new code and
the new result together, never first with the new code and the old result.
"""

from __future__ import annotations

import pytest

from gitops_sless.manifests.model import Job
from gitops_sless.plan.diff import job_results

from . import gitserver
from .test_serve import setup

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve

CODE = """
import json, os

VERSION = {version!r}

def get(event):
    if event.get("fail"):
        raise RuntimeError("the clock is broken")
    return {{"mark": event["mark"]}}

def show(event):
    return {{"code": VERSION, "seen": json.loads(os.environ["JOB_TIME"])["mark"]}}
"""


def chain(version: str, run_id: int, fail: bool = False) -> dict[str, str]:
    event = f"{{mark: run-{run_id}{', fail: true' if fail else ''}}}"
    return {
        "clock/handler.py": CODE.format(version=version),
        "clock/sless.yaml": (
            "functions:\n"
            "  - name: getter\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.get\n"
            "    jobs:\n"
            f"      - {{name: get-time, runId: {run_id}, event: {event}}}\n"
            "  - name: display\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.show\n"
            "    env: {JOB_TIME: {job: get-time}}\n"
            "    triggers: [{type: http}]\n"
        ),
    }


def replacements(output: str, name: str) -> int:
    return output.count(f"{name} replaced: r")


def test_new_code_and_a_new_run_replace_the_dependent_once(setup):
    setup.push(chain("v1", 1))
    server = setup.serve()
    assert server.call("display").json() == {"code": "v1", "seen": "run-1"}

    before = len(server.output())
    setup.push(chain("v2", 2))
    server.sync()
    assert server.call("display").json() == {"code": "v2", "seen": "run-2"}
    assert replacements(server.output()[before:], "display") == 1, server.output()[before:]


def test_a_rerun_that_fails_keeps_the_last_good_result(setup):
    setup.push(chain("v1", 1))
    server = setup.serve()
    setup.push(chain("v2", 2, fail=True))
    server.sync()
    run = next(j for j in server.jobs() if j["name"] == "get-time" and j["runId"] == 2)
    assert run["phase"] == "Failed" and "the clock is broken" in run["error"]
    # the new code is deployed with the result of the run that succeeded
    assert server.call("display").json() == {"code": "v2", "seen": "run-1"}


def _run(run_id: int, phase: str, result: str | None = None) -> dict[str, object]:
    return {"name": "clock", "run_id": run_id, "phase": phase, "result": result}


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        pytest.param([_run(1, "Succeeded", "1")], "1", id="current-succeeded"),
        pytest.param(
            [_run(1, "Succeeded", "1"), _run(2, "Succeeded", "2")], "2", id="rerun-succeeded"
        ),
        pytest.param([_run(1, "Succeeded", "1"), _run(2, "Failed")], "1", id="rerun-failed"),
        pytest.param([_run(1, "Succeeded", "1"), _run(2, "Running")], None, id="rerun-running"),
        pytest.param([_run(1, "Succeeded", "1"), _run(2, "Pending")], None, id="rerun-pending"),
    ],
)
def test_which_result_a_job_hands_on(runs, expected):
    current = 2 if any(r["run_id"] == 2 for r in runs) else 1
    jobs = {"clock": Job(name="clock", run_id=current, event={}, function="getter")}
    assert job_results(jobs, runs).get("clock") == expected


def test_a_bumped_run_not_started_yet_hands_on_nothing():
    jobs = {"clock": Job(name="clock", run_id=2, event={}, function="getter")}
    assert job_results(jobs, [_run(1, "Succeeded", "1")]) == {}


def test_run_id_zero_keeps_the_newest_result():
    jobs = {"clock": Job(name="clock", run_id=0, event={}, function="getter")}
    assert job_results(jobs, [_run(1, "Succeeded", "1")]) == {"clock": "1"}
