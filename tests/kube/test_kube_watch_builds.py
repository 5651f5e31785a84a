"""Builds and job runs followed by watch, not polled (issue 18 item 2), and CronJob runs
recorded once each, also those that ended while no reconciler ran (item 5a).

Against the test API server, whose own counters say what each sync asked, and a real
S3 server for the build contexts.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE
from ..kubeapi import FakeKube
from . import test_kube_backend as backend_tests
from .test_kube_backend import HANDLER, PROD, function_folder, wait_for

# the same cluster and reconciler as tests/kube/test_kube_backend.py
kube = backend_tests.kube
harness_for = backend_tests.harness_for

WRITES = {"apply", "create", "patch", "delete", "update"}


def reads(kube: FakeKube) -> Counter[tuple[str, str]]:
    """Requests that are not writes, by (verb, kind); a watch is one, however long."""
    counts = Counter(kube.counts()["requests"])
    return Counter({key: n for key, n in counts.items() if key[0] not in WRITES})


def test_a_first_sync_of_20_functions_reads_at_most_3_times_per_build(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    files: dict[str, str] = {}
    for i in range(20):
        files.update(function_folder(f"fn-{i:02d}", text=f"v{i}"))
    repo.commit("20", files)
    harness = harness_for(repo)
    kube.reset_counts()
    wait_for(lambda: harness.sync() and len(kube.objects("Deployment", PROD)) == 20, "20", 60)
    builds = kube.counts()["writes"].get(("create", "Job"), 0)
    assert builds == 20
    # the kinds each informer LISTs and WATCHes once: a constant, whatever N is
    fixed = sum(n for (verb, _), n in reads(kube).items() if verb in ("list", "watch"))
    per_build = reads(kube)[("log", "Pod")]
    assert per_build <= builds, reads(kube)
    assert sum(reads(kube).values()) - fixed <= 3 * builds, reads(kube)


def one_job(repo: WorkRepo) -> None:
    manifest = (
        "functions:\n  - name: once\n    runtime: python3.11\n    entrypoint: main.handler\n"
        "    jobs:\n      - name: seed\n        runId: 1\n"
    )
    repo.commit("job", {"once/sless.yaml": manifest, "once/main.py": HANDLER % "j"})


def test_a_job_run_that_ends_while_the_watch_is_cut_is_still_seen(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    one_job(repo)
    kube.job_seconds = 1.0  # long enough to cut the watch while it runs
    kube.set_job_log(PROD, "seed-run-1", '{"seeded": 3}\n')
    harness = harness_for(repo)
    harness.sync()
    wait_for(lambda: kube.get("Job", PROD, "seed-run-1"), "the run's Job")
    # the watch is cut and cannot come back until the Job has ended; by then the history
    # of its end is compacted away: the resumed watch gets 410 Gone, and a LIST finds it
    kube.inject("watch", "Job", 503, times=4)
    kube.store.drop_watches()
    wait_for(lambda: "completionTime" in kube.get("Job", PROD, "seed-run-1")["status"], "end")
    kube.store.compact()
    run = wait_for(
        lambda: (
            harness.sync()
            and (run := harness.store.job_run("prod", "seed", 1))
            and run["phase"] != "Running"
            and run
        ),
        "the run's result",
    )
    assert run["phase"] == "Succeeded" and run["result"] == '{"seeded": 3}', run


def test_a_build_pod_that_cannot_start_fails_the_build_without_polling(kube, s3_server, tmp_path):
    """The kubelet's reason comes from the watched pod: no GET of the Job, no LIST of pods."""
    from ..kube_harness import make, settings

    repo = WorkRepo(tmp_path / "repo")
    repo.commit("one", function_folder("alpha"))
    unpullable = settings(kube.kubeconfig, s3_server.config(), kaniko_image="registry.test/nope:1")
    harness = make(repo, tmp_path / "state", unpullable)
    try:
        kube.reset_counts()
        record = wait_for(
            lambda: (
                harness.sync()
                and harness.function("alpha")["phase"] == "Failed"
                and harness.function("alpha")
            ),
            "Failed",
        )
        assert "build pod cannot start: ErrImagePull" in record["message"]
        assert kube.objects("Job", NAMESPACE) == []  # the stuck Job is deleted, retried later
        asked = reads(kube)
        assert asked[("get", "Job")] == 0 and asked[("list", "Pod")] <= 1, asked
    finally:
        harness.close()


def cron_repo(repo: WorkRepo) -> None:
    manifest = (
        "functions:\n  - name: tick\n    runtime: python3.11\n    entrypoint: main.handler\n"
        "    triggers:\n      - type: cron\n        schedule: '*/5 * * * *'\n"
    )
    repo.commit("cron", {"tick/sless.yaml": manifest, "tick/main.py": HANDLER % "t"})


def ended(kube: FakeKube, job: dict[str, Any]) -> bool:
    live = kube.get("Job", PROD, job["metadata"]["name"]) or {}
    return bool((live.get("status") or {}).get("succeeded"))


def test_cron_runs_that_ended_while_no_reconciler_ran_are_recorded_once_when_one_starts(
    kube, harness_for, tmp_path
):
    repo = WorkRepo(tmp_path / "repo")
    cron_repo(repo)
    first = harness_for(repo, "first")
    first.sync()
    seen = kube.fire_cronjob(PROD, "tick-cron-0")
    wait_for(lambda: first.sync() and first.cron_runs, "the run seen while running")
    first.close()
    # no reconciler: the CronJob runs twice, and keeps both Jobs
    missed = [kube.fire_cronjob(PROD, "tick-cron-0") for _ in range(2)]
    wait_for(lambda: all(ended(kube, job) for job in missed), "the runs' ends")

    second = harness_for(repo, "second")
    second.sync()
    assert [run.function for run in second.cron_runs] == ["tick", "tick"]
    assert all(run.ok and run.at for run in second.cron_runs)
    ended_at = sorted(run.at for run in second.cron_runs)
    assert ended_at[-1] <= time.time()
    second.close()

    third = harness_for(repo, "third")
    third.sync()
    third.sync()
    assert third.cron_runs == []  # every kept run is recorded already
    names = {j["metadata"]["name"] for j in kube.objects("Job", PROD)}
    assert seen["metadata"]["name"] in names and {j["metadata"]["name"] for j in missed} <= names
