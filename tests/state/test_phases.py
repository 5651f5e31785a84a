"""Every function's phase, derived from what is true now (state/phases.py), and a pass's
result from the phases: each rule on its own, with a manifest loaded as a user writes it."""

from __future__ import annotations

import pytest

from gitops_sless.manifests import load as manifest
from gitops_sless.plan.backend import Health
from gitops_sless.plan.planner import Plan
from gitops_sless.source.snapshot import DirectorySnapshot
from gitops_sless.state.phases import STARTING, Outcome, derive, summarize

HANDLER = "def main(event):\n    return event\n"


@pytest.fixture
def desired(write_repo):
    """web (http), batch (jobs only), paused (disabled), and an invalid manifest."""

    def fn(name: str, *lines: str) -> dict[str, str]:
        head = f"functions:\n  - name: {name}\n    runtime: python3.11\n    entrypoint: h.main\n"
        return {f"{name}/sless.yaml": head + "".join(f"    {line}\n" for line in lines),
                f"{name}/h.py": HANDLER}  # fmt: skip

    files = {
        **fn("web", "triggers: [{type: http}]"),
        **fn("batch", "jobs: [{name: seed, runId: 1}]"),
        **fn("paused", "enabled: false", "triggers: [{type: http}]"),
        "broken/sless.yaml": "functions:\n  - name: broken\n",
    }
    return manifest.load(DirectorySnapshot(write_repo(files)))


def phases(desired, plan=None, outcomes=None, health=None, hashes=None):
    fields = derive(desired, plan or Plan("prod"), outcomes or {}, health or {}, hashes or {}, {})
    return {name: (f["phase"], f["message"]) for name, f in fields.items()}


def test_a_backend_that_reports_nothing_yet_shows_deployed_functions_ready(desired):
    # the local backend reports no health at all before its first replica: Ready
    assert phases(desired) == {
        "web": ("Ready", None),
        "batch": ("Ready", None),
        "paused": ("Disabled", None),
        "broken": ("Invalid", str(desired.invalid["broken/sless.yaml"])),
    }


def test_a_function_the_backend_does_not_report_yet_is_starting(desired):
    # the backend reports others: one it does not report has not been seen running
    seen = phases(desired, health={"web": Health("Ready")})
    assert seen["web"] == ("Ready", None)
    assert seen["batch"] == ("Pending", STARTING)
    assert seen["paused"] == ("Disabled", None)  # disabled wins over anything reported


def test_what_the_backend_reports_is_shown(desired):
    health = {"web": Health("Failed", "CrashLoopBackOff", "exited with code 1", 3)}
    fields = derive(desired, Plan("prod"), {}, health, {}, {})
    assert (fields["web"]["phase"], fields["web"]["message"]) == ("Failed", "CrashLoopBackOff")
    assert (fields["web"]["last_exit"], fields["web"]["restarts"]) == ("exited with code 1", 3)


def test_the_plan_decides_before_the_backend(desired):
    plan = Plan("prod", failed={"web": "build failed: pip install exited 1"},
                building={"batch": "python3.11-abc"}, waiting={"paused": "no secret"})  # fmt: skip
    seen = phases(desired, plan, health={"web": Health("Ready"), "batch": Health("Ready")})
    assert seen["web"] == ("Failed", "build failed: pip install exited 1")
    assert seen["batch"] == ("Building", None)
    assert seen["paused"] == ("Pending", "no secret")


def test_a_deploy_that_did_not_start_is_shown_until_its_spec_changes(desired):
    outcome = Outcome("hash-1", "Failed", "port taken", attempts=2, retry_at=50.0)
    plan = Plan("prod", retry_at={"web": 50.0})
    fields = derive(desired, plan, {"web": outcome}, {}, {"web": "hash-1"}, {})
    assert (fields["web"]["phase"], fields["web"]["restarts"]) == ("Failed", 2)
    assert fields["web"]["next_retry"] == 50.0
    changed = derive(desired, Plan("prod"), {"web": outcome}, {}, {"web": "hash-2"}, {})
    assert changed["web"]["phase"] == "Ready"  # a new spec: the old failure says nothing


def test_a_pass_result_from_the_phases(desired):
    ready = {"web": {"phase": "Ready"}, "batch": {"phase": "Ready"}}
    assert summarize(ready, desired, {}).result == "Invalid"  # broken/sless.yaml
    desired.invalid.clear()
    assert summarize(ready, desired, {}).result == "Succeeded"
    busy = {**ready, "batch": {"phase": "Pending", "message": STARTING}}
    assert summarize(busy, desired, {}).result == "Progressing"
    failed = summarize(ready, desired, {"seed": "exited 1"})
    assert (failed.result, failed.error) == ("Degraded", "1 failed: job seed")
