"""The reconcile loop under adversity, end to end: a real ``serve`` and a git server on loopback.

What serves survives restarts whatever the repository says now; phases heal in
the pass that fixes them; a slow build or job holds back only its own function;
a deploy that keeps failing backs off; a missing secret waits; pass results say
what happened.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .kube.test_build_cache import PKG, Package
from .sless_server import SlessServer
from .test_serve import HTTP, git_daemon, git_root, handler, http_function, manifest, setup

__all__ = ["git_daemon", "git_root", "setup"]  # fixtures, used by name

OFFLINE = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
# the gate, the job's start mark and the slow package are files of the host, which a
# sandbox hides from jobs and installers (test_sandbox covers the sandbox itself)
UNCONFINED = ["--sandbox", "off"]

GATED_JOB = """
import os, time
from pathlib import Path

def run(event):
    Path(os.environ["STARTED"]).touch()
    while not os.path.exists(os.environ["GATE"]):
        time.sleep(0.05)
    return {"done": True}
"""


class Gate:
    """A file the slow parts wait for: the test decides when they finish, never a clock."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / "open"
        self.job_started = root / "job-started"

    def open(self) -> None:
        self.path.touch()

    @property
    def is_open(self) -> bool:
        return self.path.exists()


def slow_build(name: str, package: Path) -> dict[str, str]:
    return {
        f"{name}/sless.yaml": manifest(name, HTTP),
        f"{name}/handler.py": f"import {PKG}\n\ndef main(event):\n    return 'built'\n",
        f"{name}/requirements.txt": f"{PKG} @ file://{package}\n",
    }


def slow_job(name: str, gate: Gate) -> dict[str, str]:
    env = f"    env: {{GATE: {str(gate.path)!r}, STARTED: {str(gate.job_started)!r}}}"
    return {
        f"{name}/sless.yaml": manifest(
            name,
            env,
            "    timeoutSec: 300",
            f"    jobs: [{{name: {name}-job, runId: 1}}]",
            entrypoint="handler.run",
        ),
        f"{name}/handler.py": GATED_JOB,
    }


def ask_for_a_pass(server: SlessServer) -> None:
    response = server.client.post(
        "/api/v1/sync", headers={"Authorization": f"Bearer {server.token}"}
    )
    assert response.status_code == 202, response.text


def job(server: SlessServer, name: str) -> dict | None:
    return next((j for j in server.jobs() if j["name"] == name), None)


def message(server: SlessServer, name: str) -> str | None:
    response = server.call(name)
    return response.json().get("message") if response.status_code == 200 else None


# --- one slow build or job holds back nothing else --------------------------------------


def test_a_slow_build_and_a_slow_job_hold_back_no_other_function(setup, tmp_path):
    gate = Gate(tmp_path / "gate")
    package = Package(tmp_path / "gated", gate=gate.path)
    setup.push(http_function("quick", "v1"))
    server = setup.serve(env=OFFLINE, args=UNCONFINED)
    assert message(server, "quick") == "v1"

    setup.push({**slow_build("heavy", package.path), **slow_job("chore", gate)})
    ask_for_a_pass(server)
    server.wait(lambda: package.builds(), "the slow build to start")
    server.wait(lambda: gate.job_started.exists(), "the slow job to start")

    setup.push(http_function("quick", "v2"))
    ask_for_a_pass(server)
    server.wait(lambda: message(server, "quick") == "v2", "the one-line change to serve")
    # it did not wait for them: both are still under way
    assert not gate.is_open
    assert server.function("heavy")["phase"] == "Building"
    assert job(server, "chore-job")["phase"] == "Running"
    assert server.call("heavy").status_code == 503

    gate.open()
    server.wait(
        lambda: server.call("heavy").status_code == 200,
        "the slow function to deploy after its build",
    )
    assert server.call("heavy").json() == "built"
    server.wait(lambda: job(server, "chore-job")["phase"] == "Succeeded", "the job to finish")
    server.sync()  # settled: every function serves its commit
    assert server.client.get("/api/v1/status").json()["lastSync"]["result"] == "Succeeded"


def test_start_up_serves_what_served_before_an_interrupted_job_runs_again(setup, tmp_path):
    gate = Gate(tmp_path / "gate")
    setup.push({**http_function("bystander", "here"), **slow_job("chore", gate)})
    server = SlessServer(setup.url, setup.tmp_path / "state", args=UNCONFINED)
    setup.servers.append(server)
    server.start(wait_for_sync=False)
    server.wait(lambda: gate.job_started.exists(), "the job to start")
    server.wait(lambda: message(server, "bystander") == "here", "the bystander to serve")
    server.kill()
    gate.job_started.unlink()

    again = SlessServer(setup.url, setup.tmp_path / "state", args=UNCONFINED)
    setup.servers.append(again)
    again.start(wait_for_sync=False)
    again.wait(lambda: gate.job_started.exists(), "the interrupted job to run again")
    again.wait(lambda: message(again, "bystander") == "here", "the bystander to serve again")
    assert not gate.is_open  # while the job still runs
    assert job(again, "chore-job")["phase"] == "Running"
    gate.open()
    again.wait(lambda: job(again, "chore-job")["phase"] == "Succeeded", "the job to finish")


# --- what serves survives a restart -------------------------------------------------------

NODE_SYNTAX_ERROR = "exports.main = async (event) => {\n  return {message: 'x';\n};\n"


def _broken(kind: str) -> dict[str, str]:
    """A push that breaks the function 'keep' in one of the ways a user does."""
    if kind == "yaml-quote":
        return {"keep/sless.yaml": manifest("keep", HTTP, "    env: {A: 'unclosed}")}
    if kind == "schema":
        return {"keep/sless.yaml": manifest("keep", HTTP, "    memoryMB: -10")}
    if kind == "build":
        return {
            "keep/handler.py": handler("v2"),
            "keep/requirements.txt": "no-such-package-anywhere==1\n",
        }
    if kind == "code":  # found before deploy: the handler does not parse
        return {"keep/handler.py": "def main(event):\n    return {'message': 'v2'\n"}
    if kind == "deploy":  # found by the start: the import raises
        return {"keep/handler.py": RAISES_AT_IMPORT}
    raise AssertionError(kind)


RAISES_AT_IMPORT = (
    'raise RuntimeError("the config is missing")\n\n\ndef main(event):\n    return {}\n'
)
BROKEN_PHASE = {
    "yaml-quote": "Invalid",
    "schema": "Invalid",
    "code": "Invalid",
    "build": "Failed",
    "deploy": "Failed",
}


@pytest.mark.parametrize("kind", list(BROKEN_PHASE))
def test_a_restart_keeps_serving_the_last_good_version(setup, kind):
    good = setup.push(http_function("keep", "v1"))
    server = setup.serve(env=OFFLINE)
    setup.push(_broken(kind))
    server.sync()
    assert message(server, "keep") == "v1"
    server.stop()

    again = SlessServer(setup.url, setup.tmp_path / "state", env=OFFLINE)
    setup.servers.append(again)
    again.start(wait_for_sync=False)
    again.wait(lambda: message(again, "keep") == "v1", "the last good version to serve again")
    again.sync()
    assert message(again, "keep") == "v1"
    status = again.function("keep")
    assert status["phase"] == BROKEN_PHASE[kind]
    assert status["revision"] == good
    assert again.client.get("/api/v1/status").json()["lastGoodRevision"] == good


def test_start_up_serves_before_the_remote_answers(setup, tmp_path):
    setup.push(http_function("keep", "v1"))
    server = setup.serve()
    server.stop()
    # the git server is gone: the restarted reconciler cannot fetch, and still serves
    again = SlessServer("git://127.0.0.1:9/nothing.git", setup.tmp_path / "state")
    setup.servers.append(again)
    again.start(wait_for_sync=False)
    again.wait(lambda: message(again, "keep") == "v1", "the last good version to serve")


# --- status is derived, so it heals ---------------------------------------------------------


def test_a_fixed_manifest_is_ready_again_with_no_rebuild(setup):
    original = manifest("heartbeat", HTTP)
    setup.push({"heartbeat/sless.yaml": original, "heartbeat/handler.py": handler("beat")})
    server = setup.serve()
    builds = len(server.client.get("/api/v1/builds").json())
    setup.push({"heartbeat/sless.yaml": original + "bogus: [\n"})
    server.sync()
    assert server.function("heartbeat")["phase"] == "Invalid"
    setup.push({"heartbeat/sless.yaml": original})
    sync = server.sync()
    status = server.function("heartbeat")
    assert (status["phase"], status["message"]) == ("Ready", None)
    assert sync["result"] == "Succeeded"
    assert len(server.client.get("/api/v1/builds").json()) == builds
    assert 'sless_functions{env="prod",phase="Invalid"} 0' in server.client.get("/metrics").text
    assert status_exit_code(server) == 0


def test_a_restored_handler_is_ready_again_after_a_failed_deploy(setup):
    files = {
        "clock/sless.yaml": manifest("clock", HTTP).replace("python3.11", "nodejs20"),
        "clock/handler.js": "exports.main = async () => ({message: 'tick'});\n",
    }
    setup.push(files)
    server = setup.serve()
    setup.push({"clock/handler.js": NODE_SYNTAX_ERROR})
    server.sync()
    invalid = server.function("clock")  # node --check found it: never deployed
    assert invalid["phase"] == "Invalid"
    assert "clock/handler.js:2: (code): SyntaxError" in invalid["message"]
    assert message(server, "clock") == "tick"
    setup.push({"clock/handler.js": "throw new Error('no config');\nexports.main = () => 1;\n"})
    server.sync()
    failed = server.function("clock")
    assert failed["phase"] == "Failed"
    assert "Error: no config" in failed["message"]
    setup.push(files)
    server.sync()
    assert server.function("clock")["phase"] == "Ready"
    assert message(server, "clock") == "tick"


def test_a_duplicate_name_that_is_removed_heals_the_original(setup):
    setup.push(http_function("original", "one"))
    server = setup.serve()
    setup.push({"dup/sless.yaml": manifest("original", HTTP), "dup/handler.py": handler("two")})
    server.sync()
    assert server.function("original")["phase"] == "Invalid"
    assert "already used" in server.function("original")["message"]
    setup.push({"dup/sless.yaml": None, "dup/handler.py": None})
    server.sync()
    assert server.function("original")["phase"] == "Ready"
    assert message(server, "original") == "one"


def status_exit_code(server: SlessServer) -> int:
    return subprocess.run(
        [sys.executable, "-m", "gitops_sless", "status", "--server", server.base],
        capture_output=True,
        text=True,
        env={**os.environ, "SLESS_READ_TOKEN": server.read_token or ""},
    ).returncode


# --- a deploy that keeps failing backs off --------------------------------------------------


def test_a_deploy_that_fails_backs_off_and_says_when_it_tries_again(setup):
    good = setup.push(http_function("crashy", "v1"))
    server = setup.serve(poll_interval=0.2)
    server.wait(lambda: message(server, "crashy") == "v1", "v1 to serve")
    setup.push({"crashy/handler.py": RAISES_AT_IMPORT})
    failed = server.wait(
        lambda: (f := server.function("crashy"))["phase"] == "Failed" and f, "the deploy to fail"
    )
    assert failed["restarts"] == 1
    assert failed["nextRetry"] is not None
    assert "RuntimeError: the config is missing" in failed["message"]
    assert message(server, "crashy") == "v1"  # the old version keeps serving
    # polls come every 0.2 s; the next try waits for its backoff (10 s), not for the next poll
    time.sleep(3)
    assert server.output().count("deploy.failed") == 1
    again = server.wait(
        lambda: (f := server.function("crashy"))["restarts"] == 2 and f, "the second try", 40
    )
    assert again["nextRetry"] > failed["nextRetry"]
    assert server.output().count("deploy.failed") == 2
    last = server.client.get("/api/v1/status").json()
    assert last["lastSync"]["result"] == "Degraded"
    assert last["lastGoodRevision"] == good


# --- pass results are true ---------------------------------------------------------------------


def test_a_pass_in_which_a_function_failed_is_degraded_not_succeeded(setup):
    good = setup.push(http_function("dep", "v1"))
    server = setup.serve(env=OFFLINE)
    setup.push({"dep/handler.py": handler("v2"), "dep/requirements.txt": "no-such-package==1\n"})
    sync = server.sync()
    assert sync["result"] == "Degraded"
    assert sync["error"] == "1 failed: dep"
    assert "no-such-package" in server.function("dep")["message"]
    assert server.client.get("/api/v1/status").json()["lastGoodRevision"] == good
    assert status_exit_code(server) == 1


# --- a missing secret waits --------------------------------------------------------------------

NOTES = {
    "notes/sless.yaml": manifest(
        "notes",
        HTTP,
        "    env: {DSN: {secret: notes-db, key: dsn}}",
        "    jobs: [{name: notes-create-table, runId: 1}]",
    ),
    "notes/handler.py": "import os\n\ndef main(event):\n    return {'dsn': os.environ['DSN']}\n",
}


def test_a_job_and_a_function_wait_for_their_secret_and_run_once_it_is_given(setup, tmp_path):
    setup.push(NOTES)
    server = setup.serve()
    run = job(server, "notes-create-table")
    assert run["phase"] == "Pending"
    assert "no secrets directory is configured" in run["error"]
    status = server.function("notes")
    assert status["phase"] == "Pending"
    assert server.client.get("/api/v1/status").json()["lastSync"]["result"] == "Progressing"
    assert status_exit_code(server) == 1
    server.stop()

    secrets = tmp_path / "secrets"
    (secrets / "notes-db").mkdir(parents=True)
    (secrets / "notes-db" / "dsn").write_text("postgres://db\n")
    again = SlessServer(setup.url, setup.tmp_path / "state", secrets_dir=secrets)
    setup.servers.append(again)
    again.start()
    again.sync()
    assert job(again, "notes-create-table")["phase"] == "Succeeded"
    assert again.call("notes").json() == {"dsn": "postgres://db"}
    assert again.function("notes")["phase"] == "Ready"


def test_a_restart_whose_build_is_gone_says_so_and_builds_it_again(setup):
    setup.push(http_function("keep", "v1"))
    server = setup.serve()
    server.stop()
    artifacts = setup.tmp_path / "state" / "artifacts"
    for path in artifacts.iterdir():
        if path.is_dir() and path.name.startswith("python3.11-"):
            shutil.rmtree(path)
    again = SlessServer(setup.url, setup.tmp_path / "state")
    setup.servers.append(again)
    again.start()
    again.sync()
    assert "function.unrestored" in again.output()
    assert "is gone; it is built again" in again.output()
    assert message(again, "keep") == "v1"
