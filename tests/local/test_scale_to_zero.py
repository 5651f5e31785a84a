"""Scale to zero and back, autoscaling and the limits, end to end on the local backend.

A real ``serve`` (bubblewrap sandbox) follows a repository on the git daemon;
the autoscaler runs with windows of seconds (``--scale-window`` and friends),
functions say ``idle: 1s``. What is checked is what a caller and an operator
see: answers, headers, the status API and /metrics.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from .. import gitserver
from ..paths import ROOT
from ..test_serve import manifest, setup

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve

FAST = ["--scale-window", "3s", "--scale-panic-window", "1s", "--scale-tick", "0.2s"]

PYTHON = """
import time

def main(event):
    if event.get("sleep"):
        time.sleep(float(event["sleep"]))
    return {"hello": "python"}
"""

NODE = """
exports.main = async (event) => {
  if (event.sleep) await new Promise((r) => setTimeout(r, Number(event.sleep) * 1000));
  return { hello: "node" };
};
"""


def scaled(
    name: str, *extra: str, runtime: str = "python3.11", scale: str = "min: 0, max: 4, idle: 1s"
) -> dict[str, str]:
    lines = ["    triggers: [{type: http}]", f"    scale: {{{scale}}}", *extra]
    text = manifest(name, *lines).replace("runtime: python3.11", f"runtime: {runtime}")
    source = (
        (f"{name}/handler.py", PYTHON) if runtime == "python3.11" else (f"{name}/handler.js", NODE)
    )
    return {f"{name}/sless.yaml": text, source[0]: source[1]}


def _metric(text: str, metric: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(metric) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_an_idle_function_goes_to_zero_and_the_next_call_starts_it(setup):
    setup.push({**scaled("py"), **scaled("js", runtime="nodejs20")})
    server = setup.serve(args=FAST)
    for name, said in (("py", "python"), ("js", "node")):
        server.wait(
            lambda n=name: (server.function(n) or {}).get("phase") == "Idle", f"{name} idle"
        )
        detail = server.function(name)
        assert detail["scaling"]["ready"] == 0
        assert "a call starts one" in detail["message"]
        # the first call waits for a replica, and says how long it waited
        reply = server.call(name, "/")
        assert reply.status_code == 200, server.output()[-3000:]
        assert reply.json() == {"hello": said}
        waited = int(reply.headers["x-sless-cold-start"])
        assert waited > 0
        scaling = server.wait(lambda n=name: server.function(n)["scaling"], "scaling status")
        assert scaling["lastColdStartMs"] is not None
        assert scaling["coldStarts"] >= 1
        warm = server.call(name, "/")
        assert "x-sless-cold-start" not in warm.headers
        # and it goes back to zero once nobody calls
        server.wait(lambda n=name: server.function(n)["phase"] == "Idle", f"{name} idle again")
    # the operator's views: the command line and the dashboard
    status = subprocess.run(
        [str(ROOT / ".venv/bin/gitops-sless"), "status", "--server", server.base],
        capture_output=True,
        text=True,
        env={**os.environ, "SLESS_API_TOKEN": server.api_token()},
        check=False,
    )
    line = next(row for row in status.stdout.splitlines() if row.startswith("py "))
    assert "Idle" in line and re.search(r"0/0 replicas \(0\.\.4\)", line), status.stdout
    page = server.client.get("/functions/prod/py").text
    assert "Cold starts" in page and "last " in page, page[-2000:]
    metrics = server.client.get("/metrics").text
    for phase in ("process", "runtime", "handler", "ready", "answer", "total"):
        assert _metric(metrics, "sless_cold_start_seconds_count", function="py", phase=phase) >= 1
    assert _metric(metrics, "sless_cold_start_seconds_count", runtime="nodejs20") >= 1
    assert _metric(metrics, "sless_scaled_to_zero_total", name="py") >= 1


def test_fifty_first_calls_to_an_idle_function_are_all_answered(setup):
    setup.push(scaled("burst"))
    server = setup.serve(args=FAST)
    server.wait(lambda: server.function("burst")["phase"] == "Idle", "idle")
    with ThreadPoolExecutor(50) as pool:
        replies = list(pool.map(lambda _: server.call("burst", "/"), range(50)))
    assert [r.status_code for r in replies] == [200] * 50


def test_a_burst_scales_up_within_max_and_back_down(setup):
    setup.push(scaled("slow", scale="min: 0, max: 3, target: 4, idle: 1s"))
    server = setup.serve(args=FAST)
    body = {"sleep": 0.3}
    with ThreadPoolExecutor(16) as pool:
        deadline = time.monotonic() + 30
        seen = 0
        while time.monotonic() < deadline and seen < 3:
            list(pool.map(lambda _: server.call("slow", "/", method="POST", json=body), range(16)))
            seen = max(seen, server.function("slow")["scaling"]["ready"])
    assert seen == 3, server.output()[-3000:]  # the ceiling, never above
    scaling = server.function("slow")["scaling"]
    assert scaling["desired"] <= 3
    server.wait(lambda: server.function("slow")["phase"] == "Idle", "back to zero")


def test_a_replica_that_cannot_start_on_a_wake_answers_502_with_its_cause(setup):
    # starts at deploy, then no more: its import fails once the clock passes a time
    breaks_at = time.time() + 10
    files = scaled("fragile")
    files["fragile/handler.py"] = (
        "import time\n"
        f"if time.time() > {breaks_at}:\n"
        "    raise RuntimeError('the vault is sealed')\n" + PYTHON
    )
    setup.push(files)
    server = setup.serve(args=FAST)
    server.wait(lambda: server.function("fragile")["phase"] == "Idle", "idle")
    time.sleep(max(0.0, breaks_at + 0.5 - time.time()))
    reply = server.call("fragile", "/")
    assert reply.status_code == 502
    error = reply.json()["error"]
    assert error.startswith("function failed to start:") and "the vault is sealed" in error
    # within the backoff a call is answered at once, and starts nothing (the failed
    # start's own line may land just after the 502 it caused: wait for it first)
    server.wait(lambda: "ended before it was healthy" in server.output(), "the start's line")
    log = server.output()
    again = server.call("fragile", "/")
    assert again.status_code == 502 and "the vault is sealed" in again.json()["error"]
    assert server.output().count("ended before it was healthy") == log.count(
        "ended before it was healthy"
    )


def test_a_handler_that_never_starts_fails_its_deploy_with_the_cause(setup):
    files = scaled("broken")
    files["broken/handler.py"] = "import not_a_module\n\n\ndef main(event):\n    return event\n"
    setup.push(files)
    server = setup.serve(args=FAST)
    status = server.wait(
        lambda: (f := server.function("broken")) and f["phase"] == "Failed" and f, "Failed"
    )
    assert "not_a_module" in status["message"]
    reply = server.call("broken", "/")
    assert reply.status_code == 503 and reply.json()["phase"] == "Failed"


def test_min_keeps_replicas_and_limits_answer_429_and_413(setup):
    extra = ["    rateLimit: {rps: 1, burst: 2}", "    maxBodyBytes: 100"]
    files = scaled("limited", *extra, scale="min: 1, max: 2, idle: 1s")
    setup.push(files)
    server = setup.serve(args=FAST)
    time.sleep(2)  # longer than idle: min 1 keeps one
    assert server.function("limited")["phase"] == "Ready"
    assert server.function("limited")["scaling"]["ready"] == 1
    big = server.call("limited", "/", method="POST", content=b"x" * 101)
    assert big.status_code == 413
    assert "larger than 100 bytes" in big.json()["error"]
    statuses = [server.call("limited", "/").status_code for _ in range(4)]
    assert 429 in statuses
    refused = server.call("limited", "/")
    assert refused.status_code == 429 and re.fullmatch(r"\d+", refused.headers["retry-after"])


def test_jobs_run_whatever_the_replicas(setup):
    files = scaled("batch", "    jobs: [{name: batch-once, runId: 1}]")
    setup.push(files)
    server = setup.serve(args=FAST)
    server.wait(lambda: server.function("batch")["phase"] == "Idle", "idle")
    runs = server.wait(
        lambda: [j for j in server.jobs() if j["phase"] in ("Succeeded", "Failed")], "the job"
    )
    assert [(j["name"], j["phase"]) for j in runs] == [("batch-once", "Succeeded")]
    assert '"python"' in runs[0]["result"]
