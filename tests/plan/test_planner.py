"""The planner: build only what is missing, run each job once, deploy only what changed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gitops_sless.manifests import load as manifest
from gitops_sless.manifests import model
from gitops_sless.plan.backend import deployment_for
from gitops_sless.plan.planner import Observed, plan
from gitops_sless.source.snapshot import DirectorySnapshot

from ..conftest import write_files

FILES = {
    "web/h.py": "def main(e):\n    return e\n",
    "web/sless.yaml": (
        "functions:\n"
        "  - name: web\n"
        "    runtime: python3.11\n"
        "    entrypoint: h.main\n"
        "    env: {TIME: {job: clock}}\n"
        "    triggers: [{type: http}]\n"
        "  - name: clocker\n"
        "    runtime: python3.11\n"
        "    entrypoint: h.main\n"
        "    jobs: [{name: clock, runId: 2}, {name: idle, runId: 0}]\n"
    ),
    "other/h.js": "exports.main = () => 1;\n",
    "other/sless.yaml": (
        "functions:\n"
        "  - {name: other, runtime: nodejs20, entrypoint: h.main, triggers: [{type: http}]}\n"
    ),
}


@pytest.fixture
def desired(tmp_path: Path) -> model.DesiredState:
    state = manifest.load(DirectorySnapshot(write_files(tmp_path, FILES)))
    assert not state.invalid
    return state


def observed(**overrides) -> Observed:
    fields = {
        "built": frozenset(),
        "failed_builds": {},
        "finished_runs": frozenset(),
        "job_results": {},
        "deployed": {},
        **overrides,
    }
    return Observed(**fields)


def all_built(desired: model.DesiredState) -> frozenset[str]:
    return frozenset(fn.build_tag for fn in desired.functions.values())


def test_first_pass_builds_each_tag_once(desired):
    p = plan(desired, "prod", observed())
    tags = [fn.build_tag for fn in p.builds]
    assert len(tags) == len(set(tags)) == 2  # web and clocker share a folder, so one image
    assert p.applies == [] and p.jobs == []


def test_built_functions_run_jobs_and_deploy_what_needs_nothing(desired):
    p = plan(desired, "prod", observed(built=all_built(desired)))
    assert [(fn.name, job.name, job.run_id) for fn, job in p.jobs] == [("clocker", "clock", 2)]
    assert sorted(d.name for d in p.applies) == ["clocker", "other"]
    assert p.waiting == {"web": "waiting for the result of job clock"}


def test_job_result_releases_the_dependent_function(desired):
    p = plan(
        desired,
        "prod",
        observed(
            built=all_built(desired),
            finished_runs=frozenset({("clock", 2)}),
            job_results={"clock": '"12:00"'},
        ),
    )
    assert p.jobs == []
    web = next(d for d in p.applies if d.name == "web")
    assert web.env_vars == {"TIME": '"12:00"'}


def test_nothing_changed_plans_nothing(desired):
    results = {"clock": '"12:00"'}
    deployed = {
        fn.name: deployment_for("prod", fn, results).spec_hash for fn in desired.functions.values()
    }
    p = plan(
        desired,
        "prod",
        observed(
            built=all_built(desired),
            finished_runs=frozenset({("clock", 2)}),
            job_results=results,
            deployed=deployed,
        ),
    )
    assert p.is_empty
    assert sorted(p.unchanged) == ["clocker", "other", "web"]


def test_a_new_job_result_redeploys_the_dependent(desired):
    old = {"clock": '"12:00"'}
    deployed = {
        fn.name: deployment_for("prod", fn, old).spec_hash for fn in desired.functions.values()
    }
    p = plan(
        desired,
        "prod",
        observed(
            built=all_built(desired),
            finished_runs=frozenset({("clock", 2)}),
            job_results={"clock": '"13:00"'},
            deployed=deployed,
        ),
    )
    assert [d.name for d in p.applies] == ["web"]


def test_prune_removes_only_what_no_manifest_claims(desired):
    deployed = {"gone": "x", "web": "y"}
    p = plan(desired, "prod", observed(deployed=deployed))
    assert p.prunes == ["gone"]
    desired.invalid_names["gone"] = "gone/sless.yaml"
    assert plan(desired, "prod", observed(deployed=deployed)).prunes == []


def test_failed_build_is_not_retried_while_recent(desired):
    other = desired.functions["other"].build_tag
    p = plan(desired, "prod", observed(failed_builds={other: "build failed: npm exited 1"}))
    assert [fn.name for fn in p.builds] == ["clocker"]
    assert p.failed == {"other": "build failed: npm exited 1"}


def test_dependency_on_a_job_that_never_runs_says_so(tmp_path):
    files = dict(FILES)
    files["web/sless.yaml"] = files["web/sless.yaml"].replace("{job: clock}", "{job: idle}")
    state = manifest.load(DirectorySnapshot(write_files(tmp_path, files)))
    p = plan(state, "prod", observed(built=all_built(state)))
    assert p.waiting["web"] == "waiting for job idle, which has runId 0 and never runs"


def test_replicas_and_enabled_change_the_spec_hash(desired):
    fn = desired.functions["other"]
    base = deployment_for("prod", fn, {}).spec_hash
    assert deployment_for("prod", replace(fn, replicas=2), {}).spec_hash != base
    assert deployment_for("prod", replace(fn, enabled=False), {}).spec_hash != base
    named = replace(fn, replicas_named=True)  # ``replicas: 1`` written: previews run it too
    same = deployment_for("pr-1", named, {}).spec_hash
    assert same == deployment_for("prod", named, {}).spec_hash  # same spec, another environment
    # without replicas written, a preview scales to zero: another spec (issue 27)
    assert deployment_for("pr-1", fn, {}).spec_hash != base


def test_a_failed_job_is_named_in_the_waiting_reason(desired):
    p = plan(
        desired,
        "prod",
        observed(
            built=all_built(desired),
            finished_runs=frozenset({("clock", 2)}),
            job_errors={"clock": "clocker: exited with code 1: ValueError: no"},
        ),
    )
    assert p.waiting["web"] == (
        "waiting for job clock, whose run 2 failed: clocker: exited with code 1: "
        "ValueError: no (fix it and bump runId)"
    )
