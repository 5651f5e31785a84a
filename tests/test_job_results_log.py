"""What a job returns, and what a job or a cron run prints, never reaches the server's log.

Results are shown only to those the API lets read them. A function author whose job
returns a credential it generated (or fails printing one, or a cron run that does) finds
in the reconciler's log only the outcome, the size and where to read it: the
``gitops-sless logs ... --job`` command and the API path that show it to a token holder.
End to end against a real ``serve`` (see tests/test_serve.py).
"""

from __future__ import annotations

import json

import httpx

from . import gitserver
from .test_serve import manifest, setup

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve

CANARY = "sk-live-canary-5f0c1e9d"

HANDLERS = f"""
import os

CANARY = {CANARY!r}

def returns(event):
    return {{"generated_api_key": CANARY}}

def raises(event):
    raise ValueError("cannot reach the vault with " + CANARY)

def prints(event):
    os.write(1, ("not JSON: " + CANARY).encode())  # past the runner: its real stdout
    os._exit(0)

def tick(event, context=None):
    raise ValueError("cron run holds " + CANARY)
"""

EVERY_MINUTE = '    triggers: [{type: cron, schedule: "* * * * *"}]'


def canary_repository() -> dict[str, str]:
    functions = []
    for name in ("returns", "raises", "prints"):
        functions.append(
            manifest(name, f"    jobs: [{{name: {name}-job, runId: 1}}]", entrypoint=f"keys.{name}")
        )
    functions.append(manifest("tick", EVERY_MINUTE, entrypoint="keys.tick"))
    entries = "".join(text.removeprefix("functions:\n") for text in functions)
    return {"keys/sless.yaml": "functions:\n" + entries, "keys/keys.py": HANDLERS}


def test_job_results_and_outputs_stay_out_of_the_log_and_are_read_with_a_token(setup):
    setup.push(canary_repository())
    server = setup.serve(args=["--log-format", "json"])

    def finished() -> dict[str, dict]:
        done = {j["name"]: j for j in server.jobs() if j["phase"] in ("Succeeded", "Failed")}
        return done if len(done) == 3 else {}

    runs = server.wait(finished, "the three jobs")
    server.wait(lambda: '"cron.failed"' in server.output(), "a failed cron run", timeout=150)
    # a token holder reads all of it through the API
    result = runs["returns-job"]["result"]
    assert json.loads(result) == {"generated_api_key": CANARY}
    assert CANARY in runs["raises-job"]["error"] and CANARY in runs["prints-job"]["error"]
    tick_log = server.client.get("/api/v1/environments/prod/functions/tick/logs").json()
    assert CANARY in tick_log["text"]
    # an anonymous caller does not
    anonymous = httpx.get(f"{server.base}/api/v1/environments/prod/jobs", timeout=10)
    assert anonymous.status_code == 401 and CANARY not in anonymous.text
    server.stop()

    output = server.output()
    assert CANARY not in output
    records = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    said = {(r["event"], r.get("job")): r["message"] for r in records}
    succeeded = said[("job.succeeded", "returns-job")]
    assert f"result of {len(result.encode())} bytes" in succeeded
    assert "`gitops-sless logs prod/returns --job returns-job`" in succeeded
    assert "GET /api/v1/environments/prod/jobs" in succeeded
    for job in ("raises-job", "prints-job"):
        failed = said[("job.failed", job)]
        size = len(runs[job]["error"].encode())
        assert f"its error ({size} bytes) is read with `gitops-sless logs prod/" in failed
    assert "the result is not JSON" in said[("job.failed", "prints-job")]
    (cron,) = {r["message"] for r in records if r["event"] == "cron.failed"}
    assert "GET /api/v1/environments/prod/functions/tick/logs" in cron
