"""End to end: a real ``gitops-sless serve`` following a real git server on loopback.

Every test has its own repository, state directory and server process. Passes
are started through the API (``POST /api/v1/sync?wait=...``) so nothing waits
on a poll interval.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from . import gitserver
from .conftest import processes_under, runtimes_under
from .gitserver import GitDaemon, WorkRepo, init_bare
from .sless_server import WEBHOOK_SECRET, SlessServer

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon


def handler(message: str) -> str:
    return (
        "def main(event, context):\n"
        f"    return {{'message': {message!r}, 'path': event['_path'],"
        " 'query': event['_query'], 'env': context.environment}\n"
    )


def manifest(name: str, *extra: str, entrypoint: str = "handler.main") -> str:
    lines = [
        "functions:",
        f"  - name: {name}",
        "    runtime: python3.11",
        f"    entrypoint: {entrypoint}",
        *extra,
    ]
    return "\n".join(lines) + "\n"


HTTP = "    triggers: [{type: http}]"


def http_function(name: str, message: str, *extra: str) -> dict[str, str]:
    return {
        f"{name}/sless.yaml": manifest(name, HTTP, *extra),
        f"{name}/handler.py": handler(message),
    }


class Setup:
    """One repository on the git daemon, a work tree to push from, and a server."""

    def __init__(self, tmp_path: Path, daemon: GitDaemon, git_root: Path) -> None:
        init_bare(git_root / "functions.git")
        self.url = daemon.url("functions.git")
        self.work = WorkRepo(tmp_path / "work")
        self.tmp_path = tmp_path
        self.servers: list[SlessServer] = []

    def push(self, files: dict[str, str | None], message: str = "change") -> str:
        commit = self.work.commit(message, files)
        self.work.push(self.url)
        return commit

    def serve(self, **kwargs) -> SlessServer:
        server = SlessServer(self.url, self.tmp_path / "state", **kwargs)
        self.servers.append(server)
        return server.start()


@pytest.fixture
def setup(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[Setup]:
    s = Setup(tmp_path, git_daemon, git_root)
    yield s
    for server in s.servers:
        server.stop()


def test_serves_a_repository_and_redeploys_on_push(setup):
    setup.push(http_function("greet", "hello v1"))
    server = setup.serve()
    response = server.call("greet", "/add", params={"title": "x"})
    assert response.status_code == 200, server.output()
    assert response.json() == {
        "message": "hello v1",
        "path": "/add",
        "query": {"title": "x"},
        "env": "prod",
    }
    status = server.function("greet")
    assert status["phase"] == "Ready"
    assert status["url"] == f"{server.base}/fn/prod/greet/"

    revision = setup.push(http_function("greet", "hello v2"))
    sync = server.sync()
    assert sync["revision"] == revision
    assert server.call("greet").json()["message"] == "hello v2"
    assert server.function("greet")["revision"] == revision


def test_a_pass_with_no_change_builds_and_restarts_nothing(setup):
    setup.push(http_function("steady", "same"))
    server = setup.serve()
    before = server.function("steady")
    first = server.call("steady").headers
    server.sync()
    server.sync()
    after = server.function("steady")
    assert (after["updated"], after["buildTag"]) == (before["updated"], before["buildTag"])
    builds = server.client.get("/api/v1/syncs").json()
    assert all(s["result"] == "Succeeded" for s in builds)
    assert first and server.call("steady").status_code == 200


def test_broken_manifest_keeps_the_old_version_and_says_why(setup):
    setup.push(http_function("keep", "still here"))
    server = setup.serve()
    assert server.call("keep").json()["message"] == "still here"

    broken = manifest("keep", HTTP, "    memoryMB: -10")
    setup.push({"keep/sless.yaml": broken, "keep/handler.py": handler("never served")})
    sync = server.sync()
    assert sync["result"] == "Invalid"
    status = server.function("keep")
    assert status["phase"] == "Invalid"
    assert status["message"] == (
        "keep/sless.yaml:6: functions[0].memoryMB: -10 is less than the minimum of 64"
    )
    assert server.call("keep").json()["message"] == "still here"


def test_deleting_a_function_folder_removes_its_route_at_once(setup):
    setup.push({**http_function("gone", "bye"), **http_function("stays", "hi")})
    server = setup.serve()
    assert server.call("gone").status_code == 200
    setup.push({"gone/sless.yaml": None, "gone/handler.py": None})
    server.sync()
    response = server.call("gone")
    assert response.status_code == 404
    assert response.json()["error"]
    assert server.function("gone") is None
    assert server.call("stays").status_code == 200


JOB_HANDLER = """
import json, os, time

def run(event):
    with open(os.environ["COUNTER"], "a") as f:
        f.write(event["mark"] + "\\n")
    return {"mark": event["mark"], "at": time.time()}

def show(event):
    return {"seen": json.loads(os.environ["JOB_RESULT"])["mark"]}
"""


def job_repo(counter: Path, run_id: int) -> dict[str, str]:
    return {
        "jobs/handler.py": JOB_HANDLER,
        "jobs/sless.yaml": (
            "functions:\n"
            "  - name: worker\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.run\n"
            f"    env: {{COUNTER: {str(counter)!r}}}\n"
            "    jobs:\n"
            f"      - {{name: stamp, runId: {run_id}, event: {{mark: run-{run_id}}}}}\n"
            "  - name: shower\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.show\n"
            "    env: {JOB_RESULT: {job: stamp}}\n"
            "    triggers: [{type: http}]\n"
        ),
    }


def test_jobs_run_once_per_run_id_and_hand_their_result_on(setup, tmp_path):
    counter = tmp_path / "job-runs"
    setup.push(job_repo(counter, 1))
    # the job counts its runs in a file of the host, which a sandbox would not let it write
    server = setup.serve(args=["--sandbox", "off"])
    assert counter.read_text().splitlines() == ["run-1"]
    assert server.call("shower").json() == {"seen": "run-1"}
    job = next(j for j in server.jobs() if j["name"] == "stamp")
    assert job["phase"] == "Succeeded" and json.loads(job["result"])["mark"] == "run-1"

    setup.push({"jobs/README": "unrelated change"})
    server.sync()
    assert counter.read_text().splitlines() == ["run-1"]  # not run again

    setup.push(job_repo(counter, 2))
    server.sync()
    assert counter.read_text().splitlines() == ["run-1", "run-2"]
    assert server.call("shower").json() == {"seen": "run-2"}  # redeployed with the new result


def test_disabled_function_stays_listed_but_does_not_serve(setup):
    setup.push(http_function("sleepy", "awake"))
    server = setup.serve()
    assert server.call("sleepy").status_code == 200
    setup.push(http_function("sleepy", "awake", "    enabled: false"))
    server.sync()
    assert server.function("sleepy")["phase"] == "Disabled"
    response = server.call("sleepy")
    assert response.status_code == 503
    setup.push(http_function("sleepy", "awake again"))
    server.sync()
    assert server.call("sleepy").json()["message"] == "awake again"


def test_remote_unreachable_keeps_serving_and_reports_the_error(setup, git_daemon):
    setup.push(http_function("solid", "up"))
    server = setup.serve()
    git_daemon.stop()
    sync = server.sync()
    assert sync["result"] == "Failed"
    assert "fetch" in sync["error"] and "127.0.0.1" in sync["error"]
    assert server.call("solid").json()["message"] == "up"
    status = server.client.get("/api/v1/status").json()
    assert status["lastSync"]["result"] == "Failed"
    assert status["lastGoodRevision"]  # the last good revision is still reported
    assert server.function("solid")["phase"] == "Ready"


def _github(body: bytes, secret: str = WEBHOOK_SECRET) -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {
        "X-Hub-Signature-256": f"sha256={digest}",
        "X-GitHub-Event": "push",
        "Content-Type": "application/json",
    }


def test_webhooks_sync_only_with_a_valid_signature(setup):
    setup.push(http_function("hooked", "v1"))
    server = setup.serve()
    setup.push(http_function("hooked", "v2"))
    body = json.dumps({"ref": "refs/heads/main"}).encode()

    passes = len(server.syncs())
    bad = server.client.post("/api/v1/webhooks/github", content=body, headers=_github(body, "x"))
    assert bad.status_code == 401
    missing = server.client.post("/api/v1/webhooks/github", content=body)
    assert missing.status_code == 401
    time.sleep(0.5)
    assert len(server.syncs()) == passes
    assert server.call("hooked").json()["message"] == "v1"

    other = json.dumps({"ref": "refs/heads/feature"}).encode()
    ignored = server.client.post("/api/v1/webhooks/github", content=other, headers=_github(other))
    assert ignored.status_code == 200 and ignored.json()["accepted"] is False

    good = server.client.post("/api/v1/webhooks/github", content=body, headers=_github(body))
    assert good.status_code == 202
    server.wait(lambda: server.call("hooked").json()["message"] == "v2", "the webhook's sync")

    huge = b"{" + b" " * (1 << 20) + b"}"
    assert (
        server.client.post(
            "/api/v1/webhooks/github", content=huge, headers=_github(huge)
        ).status_code
        == 413
    )


def test_mutating_api_calls_need_the_token(setup):
    setup.push(http_function("api", "x"))
    server = setup.serve()
    assert server.client.post("/api/v1/sync").status_code == 401
    wrong = server.client.post("/api/v1/sync", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert server.client.get("/api/v1/status").status_code == 200


def test_without_a_token_configured_a_generated_one_alone_syncs(setup):
    setup.push(http_function("closed", "x"))
    server = setup.serve(token=None)
    response = server.client.post("/api/v1/sync", headers={"Authorization": "Bearer guess"})
    assert response.status_code == 401
    assert server.sync()["finished"]  # with the token the server keeps in its state folder


def test_proxy_errors_are_json_and_never_leave_the_route_table(setup):
    setup.push(http_function("edge", "x"))
    server = setup.serve()
    for path in ("/fn/prod/nope/", "/fn/prod/..%2f..%2fapi/v1/status", "/fn/prod/%2e%2e/x"):
        response = server.client.get(path)
        assert response.status_code == 404, path
        assert response.headers["content-type"].startswith("application/json")
    big = server.call("edge", method="POST", content=b"x" * ((1 << 20) + 1))
    assert big.status_code == 413
    ok = server.call("edge", headers={"Connection": "x-secret", "X-Secret": "1"})
    assert ok.status_code == 200 and "x-request-id" in ok.headers


def test_invocations_and_metrics_are_recorded(setup):
    setup.push(http_function("counted", "x"))
    server = setup.serve()
    for _ in range(3):
        server.call("counted", "/a")
    server.call("missing")

    def recorded():
        detail = server.function("counted")
        return len(detail["invocations"]) >= 3 and detail

    detail = server.wait(recorded, "invocations to be flushed", timeout=10)
    assert {(i["path"], i["status"]) for i in detail["invocations"]} == {("/a", 200)}
    metrics = server.client.get("/metrics").text
    assert 'sless_invocations_total{env="prod",name="counted",status="200"} 3' in metrics
    assert "sless_proxy_latency_seconds_bucket" in metrics
    assert 'sless_syncs_total{env="prod",result="Succeeded"}' in metrics
    assert 'sless_functions{env="prod",phase="Ready"} 1' in metrics
    assert 'sless_functions{env="prod",phase="Failed"} 0' in metrics
    assert "sless_build_duration_seconds_count 1" in metrics
    assert "sless_sync_duration_seconds_count" in metrics
    stamp = next(
        line.split()[-1]
        for line in metrics.splitlines()
        if line.startswith('sless_last_successful_sync_timestamp_seconds{env="prod"}')
    )
    assert abs(float(stamp) - time.time()) < 600


def test_secrets_come_from_the_secrets_directory_and_a_missing_one_waits(setup, tmp_path):
    secrets = tmp_path / "secrets"
    (secrets / "db").mkdir(parents=True)
    (secrets / "db" / "dsn").write_text("postgres://example\n")
    files = {
        "sec/handler.py": "import os\ndef main(event):\n    return {'dsn': os.environ['DSN']}\n",
        "sec/sless.yaml": manifest("sec", HTTP, "    env: {DSN: {secret: db, key: dsn}}"),
        "nosec/handler.py": "def main(event):\n    return 1\n",
        "nosec/sless.yaml": manifest("nosec", HTTP, "    env: {DSN: {secret: db, key: missing}}"),
    }
    setup.push(files)
    server = setup.serve(secrets_dir=secrets)
    assert server.call("sec").json() == {"dsn": "postgres://example"}
    status = server.function("nosec")
    # as a pod waits for a missing Secret: Pending with why, never started without it
    assert status["phase"] == "Pending"
    assert "secret 'db' key 'missing': no file" in status["message"]
    assert "postgres://example" not in server.output()


def test_cron_fires_with_standard_semantics(setup, tmp_path):
    marks = tmp_path / "cron-marks"
    files = {
        "tick/handler.py": (
            "import os\n"
            "def main(event):\n"
            "    open(os.environ['MARKS'], 'a').write(event['source'] + '\\n')\n"
            "    return {'ok': True}\n"
        ),
        "tick/sless.yaml": manifest(
            "tick",
            f"    env: {{MARKS: {str(marks)!r}}}",
            "    triggers: [{type: cron, schedule: '* * * * *', event: {source: cron}}]",
        ),
    }
    setup.push(files)
    server = setup.serve(args=["--sandbox", "off"])  # the marks are a file of the host
    assert server.function("tick")["phase"] == "Ready"
    # '* * * * *' fires at the start of the next minute
    server.wait(lambda: marks.exists() and marks.read_text() == "cron\n", "the cron run", 75)

    def recorded():
        runs = server.function("tick")["invocations"]
        return runs and runs[0]

    run = server.wait(recorded, "the cron run to be recorded", 10)
    assert (run["method"], run["path"], run["status"]) == ("CRON", "cron/0", 200)


SLOW_DEP = {
    "slow/handler.js": "exports.main = async () => ({ dep: require('slowdep').name });\n",
    "slow/sless.yaml": (
        "functions:\n"
        "  - {name: slow, runtime: nodejs20, entrypoint: handler.main, triggers: [{type: http}]}\n"
    ),
    "slow/package.json": json.dumps(
        {"name": "slow", "private": True, "dependencies": {"slowdep": "file:./slowdep"}}
    ),
    "slow/slowdep/index.js": "module.exports = { name: 'slowdep' };\n",
}


def test_restart_mid_build_builds_once(setup, tmp_path):
    starts, installs = tmp_path / "starts", tmp_path / "installs"
    package = {
        "name": "slowdep",
        "version": "1.0.0",
        # the install script is the build's slow step; it leaves a line when it starts
        # and another when it finishes
        "scripts": {"install": f"echo start >> {starts} && sleep 4 && echo done >> {installs}"},
    }
    setup.push({**SLOW_DEP, "slow/slowdep/package.json": json.dumps(package)})
    offline = {"npm_config_offline": "true"}
    # the install script marks its start and end in files of the host: no sandbox
    unconfined = ["--sandbox", "off"]
    server = SlessServer(setup.url, tmp_path / "state", env=offline, args=unconfined)
    setup.servers.append(server)
    server.start(wait_for_sync=False)
    server.wait(starts.exists, "the installer to start")
    assert server.function("slow")["phase"] == "Building"
    server.kill()  # mid-build: the installer is still sleeping

    again = SlessServer(setup.url, tmp_path / "state", env=offline, args=unconfined)
    setup.servers.append(again)
    again.start()
    again.wait(lambda: again.function("slow")["phase"] == "Ready", "the rebuilt function")
    assert again.call("slow").json() == {"dep": "slowdep"}
    again.sync()
    time.sleep(4.5)  # long enough for an orphaned installer of the first run to finish
    assert starts.read_text() == "start\nstart\n"  # interrupted once, then built once
    assert installs.read_text() == "done\n"
    detail = again.function("slow")
    assert detail["build"]["phase"] == "Succeeded"


def test_force_push_wins(setup):
    setup.push(http_function("forced", "original"))
    server = setup.serve()
    setup.work.write(http_function("forced", "forced"))
    setup.work.git("add", "--all")
    rewritten = setup.work.amend("history rewritten")  # the pushed commit is replaced
    setup.work.push(setup.url, force=True)
    assert server.sync()["revision"] == rewritten
    assert server.call("forced").json()["message"] == "forced"


def test_failed_build_keeps_the_old_version_serving(setup):
    good = {
        "dep/handler.py": handler("old"),
        "dep/sless.yaml": manifest("dep", HTTP),
    }
    setup.push(good)
    server = setup.serve(env={"PIP_NO_INDEX": "1"})
    assert server.call("dep").json()["message"] == "old"
    setup.push({"dep/handler.py": handler("new"), "dep/requirements.txt": "no-such-package==1\n"})
    server.sync()
    status = server.function("dep")
    assert status["phase"] == "Failed"
    assert "pip install exited" in status["message"]
    assert "no-such-package" in status["message"]  # the log tail says why
    # pip's own reason on the first line, the one status shows
    first = status["message"].splitlines()[0]
    assert first.startswith("build failed: pip install exited 1: ")
    assert "No matching distribution found for no-such-package" in first
    assert server.call("dep").json()["message"] == "old"
    # logs --build shows the build that failed, not the one still serving
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLESS_")}
    env |= {"SLESS_SERVER": server.base, "SLESS_API_TOKEN": server.api_token() or ""}
    logs = subprocess.run(
        [sys.executable, "-m", "gitops_sless", "logs", "prod/dep", "--build"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert logs.returncode == 0, logs.stderr
    assert "no-such-package" in logs.stdout


def test_stopping_the_server_stops_every_process_it_started(setup, tmp_path):
    setup.push({**http_function("one", "1"), **http_function("two", "2")})
    server = setup.serve()
    setup.push(http_function("one", "1 again"))  # a replacement leaves replicas draining
    server.sync()
    assert len(processes_under(tmp_path / "state")) >= 2
    server.stop()
    assert processes_under(tmp_path / "state") == []


def test_a_replica_that_dies_is_restarted(setup, tmp_path):
    setup.push(http_function("phoenix", "alive"))
    server = setup.serve()
    (first,) = runtimes_under(tmp_path / "state" / "artifacts")
    os.kill(first, signal.SIGKILL)
    server.wait(
        lambda: (pids := runtimes_under(tmp_path / "state" / "artifacts")) and pids != [first],
        "a new replica",
        15,
    )
    server.wait(lambda: server.call("phoenix").status_code == 200, "the function to answer", 15)
    assert server.call("phoenix").json()["message"] == "alive"


def test_a_redeploy_drops_no_request(setup):
    setup.push(http_function("busy", "v1"))
    server = setup.serve()
    statuses: list[int] = []
    messages: set[str] = set()
    stop = threading.Event()

    def hammer() -> None:
        with httpx.Client(base_url=server.base, timeout=10) as client:
            while not stop.is_set():
                response = client.get("/fn/prod/busy/")
                statuses.append(response.status_code)
                if response.status_code == 200:
                    messages.add(response.json()["message"])

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        for version in ("v2", "v3"):
            setup.push(http_function("busy", version))
            server.sync()
        time.sleep(1.5)  # past the old replicas' drain
    finally:
        stop.set()
        thread.join()
    assert len(statuses) > 50
    assert set(statuses) == {200}
    assert {"v1", "v3"} <= messages
