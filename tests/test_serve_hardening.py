"""End to end: what a new user and a bad push hit, against a real ``serve`` and git server.

A manifest that cannot be read keeps what it last declared; a declared
function that does not serve answers 503, not 404; the log says what
happened and never a secret; no-op polls do not fill the history; a job
interrupted by a crash runs again.
"""

from __future__ import annotations

import json
import os
import time

from . import gitserver
from .sless_server import TOKEN, WEBHOOK_SECRET, SlessServer
from .test_serve import HTTP, handler, http_function, manifest, setup

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve

ALIAS_BOMB = (
    "x-0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"x-{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 10)}]\n" for i in range(1, 10))
    + manifest("keep", HTTP)
)


def _symlinked(work) -> dict[str, str | None]:
    """sless.yaml becomes a symlink to a valid manifest next to it."""
    (work.path / "keep" / "real.yaml").write_text(manifest("keep", HTTP))
    target = work.path / "keep" / "sless.yaml"
    target.unlink()
    os.symlink("real.yaml", target)
    return {}


UNREADABLE = {
    "yaml-syntax": lambda work: {"keep/sless.yaml": manifest("keep", HTTP, "    replicas: [1")},
    "not-utf8": lambda work: {"keep/sless.yaml": b"functions:\n  - name: k\xfceep\n"},
    "too-large": lambda work: {
        "keep/sless.yaml": manifest("keep", HTTP) + "# " + "x" * (300 * 1024) + "\n"
    },
    "alias-bomb": lambda work: {"keep/sless.yaml": ALIAS_BOMB},
    "symlink": _symlinked,
}


def test_a_manifest_that_cannot_be_read_keeps_its_functions_until_it_is_deleted(setup):
    setup.push({**http_function("keep", "v1"), **http_function("other", "o")})
    server = setup.serve()
    first = server.function("keep")
    assert server.call("keep").json()["message"] == "v1"

    for what, breakage in UNREADABLE.items():
        setup.push(breakage(setup.work), message=what)
        assert server.sync()["result"] == "Invalid", what
        status = server.function("keep")
        assert status is not None, f"{what}: the function disappeared"
        assert status["phase"] == "Invalid", what
        assert status["message"].startswith("keep/sless.yaml:"), (what, status["message"])
        assert status["revision"] == first["revision"], "it still serves the first revision"
        assert server.call("keep").json()["message"] == "v1", what
        listed = server.client.get("/api/v1/environments/prod/functions").json()
        assert "keep" in {f["name"] for f in listed}, what

    setup.push({"keep/sless.yaml": None, "keep/real.yaml": None})
    server.sync()
    assert server.function("keep") is None
    assert server.call("keep").status_code == 404
    assert server.call("other").json()["message"] == "o"


def test_a_declared_function_that_does_not_serve_answers_503_with_its_phase(setup):
    files = {
        **http_function("ready", "up"),
        "nosecret/handler.py": handler("never"),
        "nosecret/sless.yaml": manifest("nosecret", HTTP, "    env: {DSN: {secret: db, key: k}}"),
        "plain/handler.py": handler("not callable"),
        "plain/sless.yaml": manifest("plain"),
    }
    setup.push(files)
    server = setup.serve()
    response = server.call("nosecret")
    assert response.status_code == 503
    body = response.json()
    assert body["phase"] == "Pending"  # waits for its secret, as a pod does
    assert "secret 'db' key 'k'" in body["message"]
    assert server.call("nobody-declares-this").status_code == 404
    plain = server.call("plain")  # declared, Ready, but with no http trigger to call
    assert plain.status_code == 404 and "no http trigger" in plain.json()["error"]

    metrics = server.wait(
        lambda: (
            'name="nosecret",status="503"' in (text := server.client.get("/metrics").text) and text
        ),
        "the 503 to be counted",
        timeout=10,
    )
    assert 'sless_invocations_total{env="prod",name="",' not in metrics


def _json_lines(text: str) -> list[dict]:
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


JOB_SECRET = "s3cr3t-value-that-must-never-be-logged"


def test_the_log_says_what_happened_in_json_and_never_a_secret(setup, tmp_path):
    secrets = tmp_path / "secrets"
    (secrets / "vault").mkdir(parents=True)
    (secrets / "vault" / "token").write_text(JOB_SECRET + "\n")
    leaky = "import os\ndef leak(event):\n    return {'token': os.environ['TOKEN']}\n"
    files = {
        **http_function("greet", "v1"),
        "leaky/handler.py": leaky,
        "leaky/sless.yaml": manifest(
            "leaky",
            "    env: {TOKEN: {secret: vault, key: token}}",
            "    jobs: [{name: leak-it, runId: 1}]",
            entrypoint="handler.leak",
        ),
    }
    setup.push(files)
    server = setup.serve(secrets_dir=secrets, args=["--log-format", "json"])
    job = server.wait(
        lambda: next((j for j in server.jobs() if j["phase"] == "Succeeded"), None), "the job"
    )
    assert JOB_SECRET in job["result"]  # the handler really returned it

    revision = setup.push({"greet/sless.yaml": manifest("greet", HTTP, "    memoryMB: -5")})
    server.sync()
    setup.push(http_function("greet", "v2"))
    server.sync()
    setup.push({"greet/sless.yaml": None, "greet/handler.py": None})
    server.sync()
    server.stop()

    output = server.output()
    for secret in (JOB_SECRET, TOKEN, WEBHOOK_SECRET):
        assert secret not in output
    events = _json_lines(output)
    assert events, output[-2000:]
    for event in events:
        assert {"time", "level", "event", "message"} <= set(event)
        assert event["time"].endswith("Z")
    by_name = {}
    for event in events:
        by_name.setdefault(event["event"], []).append(event)
    for name in (
        "sync.started",
        "sync.finished",
        "build.started",
        "build.finished",
        "function.deployed",
        "function.replaced",
        "function.pruned",
        "job.started",
        "job.succeeded",
        "manifest.invalid",
        "server.stopping",
    ):
        assert name in by_name, f"no {name} event in:\n{output[-3000:]}"
    (invalid,) = by_name["manifest.invalid"]
    assert invalid["message"] == (
        "greet/sless.yaml:6: functions[0].memoryMB: -5 is less than the minimum of 64"
    )
    assert invalid["env"] == "prod" and invalid["revision"] == revision[:12]
    build = by_name["build.finished"][0]
    assert build["env"] == "prod" and build["tag"] and build["function"]
    finished = by_name["sync.finished"][-1]
    assert finished["syncId"] and finished["revision"] and finished["result"]
    assert "result of" in by_name["job.succeeded"][0]["message"]  # its size, not its content


def test_polls_that_change_nothing_do_not_fill_the_history(setup):
    setup.push(http_function("steady", "x"))
    server = setup.serve(poll_interval=0.2)
    time.sleep(3)
    changed = setup.push(http_function("steady", "y"))
    server.wait(lambda: server.call("steady").json()["message"] == "y", "the poll to deploy")
    time.sleep(2)
    syncs = server.client.get("/api/v1/syncs").json()
    said = [(s["trigger"], s["result"], s["count"], s["error"]) for s in syncs]
    assert len(syncs) <= 3, said  # the first pass, the deploy, and the quiet polls after it
    assert any(s["revision"] == changed for s in syncs)
    assert sum(s["count"] for s in syncs) >= 10  # every poll is counted, on the rows it repeats
    quiet = next(s for s in syncs if s["count"] > 1)
    assert quiet["lastSeen"] >= quiet["finished"]


def test_a_deploy_waiting_for_a_secret_is_retried_quietly(setup, tmp_path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    setup.push(
        {
            "nosecret/handler.py": handler("got it"),
            "nosecret/sless.yaml": manifest("nosecret", HTTP, "    env: {S: {secret: db, key: k}}"),
        }
    )
    server = setup.serve(poll_interval=0.2, secrets_dir=secrets)
    time.sleep(3)
    syncs = server.client.get("/api/v1/syncs").json()
    # the pass that started the build, the one that tried the deploy, then only repeats of it
    assert len(syncs) <= 2 and syncs[0]["count"] >= 5, syncs
    assert server.output().count("deploy.waiting") == 1, server.output()[-3000:]
    # retried on every pass: the secret appears without a commit and the function starts
    (secrets / "db").mkdir()
    (secrets / "db" / "k").write_text("v\n")
    server.wait(lambda: server.call("nosecret").status_code == 200, "the retry to succeed")
    assert server.function("nosecret")["phase"] == "Ready"


def test_status_reports_the_fetched_revision_and_what_each_function_serves(setup):
    good = setup.push(http_function("served", "v1"))
    server = setup.serve()
    broken = setup.push({"served/sless.yaml": manifest("served", HTTP, "    replicas: [1")})
    server.sync()
    status = server.client.get("/api/v1/status").json()
    assert status["fetchedRevision"] == broken
    assert status["lastGoodRevision"] == good
    assert server.function("served")["revision"] == good


SLOW_JOB = """
import time

def run(event):
    time.sleep(6)
    return {"done": True}
"""


def test_a_job_interrupted_by_a_crash_runs_again_without_a_run_id_bump(setup):
    setup.push(
        {
            "slow/handler.py": SLOW_JOB,
            "slow/sless.yaml": manifest(
                "slow",
                "    timeoutSec: 60",
                "    jobs: [{name: six-seconds, runId: 1}]",
                entrypoint="handler.run",
            ),
        }
    )
    server = SlessServer(setup.url, setup.tmp_path / "state")
    setup.servers.append(server)
    server.start(wait_for_sync=False)  # the first pass lasts as long as the job
    # the sandboxed job can mark nothing on the host: the API says it runs
    server.wait(
        lambda: any(j["name"] == "six-seconds" and j["phase"] == "Running" for j in server.jobs()),
        "the job to start",
        timeout=60,
    )
    server.kill()

    again = setup.serve()
    run = again.wait(
        lambda: next(
            (j for j in again.jobs() if j["name"] == "six-seconds" and j["phase"] == "Succeeded"),
            None,
        ),
        "the job to run again and succeed",
        timeout=60,
    )
    assert run["runId"] == 1
    assert run["attempts"] == 2
    assert json.loads(run["result"]) == {"done": True}


# the hog holds its memory for seconds: the RSS watchdog looks every 0.2 s (where no
# cgroup enforces the limit), and a replica that allocated, touched and answered within
# one look would be gone before the watchdog saw it (a clean-clone run, under load)
MEMORY_HOG = """
import time

def main(event):
    if event["_path"] == "/hog":
        hog = bytearray(400 << 20)
        for i in range(0, len(hog), 4096):
            hog[i] = 1
        time.sleep(10)
        return len(hog)
    return "fine"
"""


def test_a_replica_over_its_memory_limit_is_killed_reported_and_restarted(setup):
    setup.push(
        {
            "hog/handler.py": MEMORY_HOG,
            "hog/sless.yaml": manifest("hog", HTTP, "    memoryMB: 128"),
            **http_function("bystander", "unaffected"),
        }
    )
    server = setup.serve()
    assert server.call("hog").json() == "fine"

    response = server.call("hog", "/hog")
    assert response.status_code == 502
    assert "OOMKilled" in response.json()["error"]
    status = server.wait(
        lambda: (f := server.function("hog")) and f["lastExit"] and f, "the exit to be reported"
    )
    assert "OOMKilled" in status["lastExit"] and "128" in status["lastExit"]
    assert status["restarts"] >= 1
    assert server.call("bystander").json()["message"] == "unaffected"
    server.wait(lambda: server.call("hog").status_code == 200, "the replica to come back")
    assert server.call("hog").json() == "fine"


def test_garbage_collection_keeps_what_runs_and_reports_what_it_reclaimed(setup):
    setup.push(http_function("churn", "v0"))
    server = setup.serve(
        args=["--gc-interval", "0.5", "--keep-builds", "0", "--keep-revisions", "1"]
    )
    for version in (1, 2, 3):
        setup.push(http_function("churn", f"v{version}"))
        server.sync()
    artifacts = setup.tmp_path / "state" / "artifacts"
    serving = server.function("churn")["buildTag"]

    def collected() -> bool:
        built = {p.name for p in artifacts.iterdir() if p.is_dir() and "-" in p.name}
        return built == {serving}

    server.wait(collected, "old artifacts to be collected", timeout=30)
    assert server.call("churn").json()["message"] == "v3"
    metrics = server.client.get("/metrics").text
    reclaimed = next(
        line for line in metrics.splitlines() if line.startswith("sless_gc_reclaimed_bytes_total")
    )
    assert float(reclaimed.split()[-1]) > 0


def test_a_secret_and_the_token_appear_in_no_page_response_metric_or_log(setup, tmp_path):
    secret = "hunter2-but-much-longer-and-unique"
    secrets = tmp_path / "secrets"
    (secrets / "db").mkdir(parents=True)
    (secrets / "db" / "dsn").write_text(secret + "\n")
    uses = "import os\ndef main(event):\n    return {'length': len(os.environ['DSN'])}\n"
    setup.push(
        {
            "uses/handler.py": uses,
            "uses/sless.yaml": manifest("uses", HTTP, "    env: {DSN: {secret: db, key: dsn}}"),
        }
    )
    server = setup.serve(secrets_dir=secrets)
    assert server.call("uses").json() == {"length": len(secret)}
    server.wait(lambda: server.function("uses")["invocations"], "the call to be recorded")
    paths = [
        "/",
        "/functions/prod/uses",
        "/metrics",
        "/openapi.json",
        "/api/v1/status",
        "/api/v1/syncs",
        "/api/v1/environments",
        "/api/v1/environments/prod/functions",
        "/api/v1/environments/prod/functions/uses",
        "/api/v1/environments/prod/jobs",
    ]
    for path in paths:
        response = server.client.get(path)
        assert response.status_code == 200, path
        assert secret not in response.text and TOKEN not in response.text, path
    server.stop()
    assert secret not in server.output() and TOKEN not in server.output()


def test_the_start_up_listing_names_every_function_and_why_it_is_not_ready(setup):
    setup.push(
        {
            **http_function("up", "u"),
            **http_function("paused", "p", "    enabled: false"),
            "broken/handler.py": handler("b"),
            "broken/sless.yaml": manifest("broken", HTTP, "    env: {S: {secret: db, key: k}}"),
        }
    )
    server = setup.serve()
    output = server.wait(lambda: "API docs:" in (text := server.output()) and text, "listing")
    assert f"Ready     curl {server.base}/fn/prod/up/" in output
    assert f"Disabled  curl {server.base}/fn/prod/paused/\n" in output
    # the reason follows on its own lines, indented, whole (see test_serve_banner.py)
    pending = f"Pending   curl {server.base}/fn/prod/broken/\n"
    assert pending + "            secret 'db' key 'k'" in output
