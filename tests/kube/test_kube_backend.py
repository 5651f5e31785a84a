"""The Kubernetes backend against the test API server (tests/kubeapi) and a real S3 server.

Every object the backend writes is validated by the test API server with
kubernetes-validate (strict, 1.30); kaniko Jobs succeed only when the build
context they name exists in the bucket and holds the Dockerfile and the
function's files. Writes and requests are counted by the API server itself.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from gitops_sless.kube.client import Forbidden, KubeClient
from gitops_sless.kube.renderer import build_job_name
from gitops_sless.web.dashboard import Pages

from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, REGISTRY, Harness, make, settings
from ..kubeapi import FakeKube
from ..paths import SAMPLE
from ..s3server import S3Server

PROD = "sless-prod"

HANDLER = "def handler(event, context):\n    return {'from': %r}\n"


def function_folder(name: str, text: str = "v1", **extra: str) -> dict[str, str]:
    manifest = (
        "functions:\n"
        f"  - name: {name}\n"
        "    runtime: python3.11\n"
        "    entrypoint: main.handler\n"
        "    triggers:\n"
        "      - type: http\n"
    )
    return {f"{name}/sless.yaml": manifest, f"{name}/main.py": HANDLER % text, **extra}


def writes(kube: FakeKube) -> dict[tuple[str, str], int]:
    return {key: n for key, n in kube.counts()["writes"].items() if n}


def requests(kube: FakeKube) -> int:
    return sum(kube.counts()["requests"].values())


def creates(kube: FakeKube, kind: str) -> int:
    return kube.counts()["writes"].get(("create", kind), 0)


@pytest.fixture
def kube(fake_kube: FakeKube) -> FakeKube:
    client = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    return fake_kube


@pytest.fixture
def harness_for(kube: FakeKube, s3_server: S3Server, tmp_path: Path):
    made: list[Harness] = []

    kube.keep_out_of_builds(s3_server.secret_key)

    def build(repo: WorkRepo, state: str = "state", **options: Any) -> Harness:
        harness = make(
            repo, tmp_path / state, settings(kube.kubeconfig, s3_server.config()), **options
        )
        made.append(harness)
        return harness

    yield build
    for harness in made:
        harness.close()


def sample_repo(tmp_path: Path) -> WorkRepo:
    repo = WorkRepo(tmp_path / "sample")
    shutil.copytree(SAMPLE, repo.path, dirs_exist_ok=True)
    repo.commit("sample")
    return repo


def wait_for(check: Any, what: str, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def images(obj: dict[str, Any]) -> list[str]:
    spec = obj["spec"]
    if "jobTemplate" in spec:
        spec = spec["jobTemplate"]["spec"]
    return [c["image"] for c in spec["template"]["spec"]["containers"]]


# --- the first sync ---------------------------------------------------------------------


def test_first_sync_of_the_sample_repository(kube, harness_for, tmp_path):
    repo = sample_repo(tmp_path)
    kube.set_job_log(PROD, "get-time-py-run-1", 'log line\n{"utc": "2026-12-01T00:00:00Z"}\n')
    kube.set_job_log(PROD, "get-time-node-run-1", '{"utc": "2026-12-01T00:00:01Z"}\n')
    harness = harness_for(repo)
    harness.sync()

    deployments = kube.objects("Deployment", PROD)
    assert {d["metadata"]["name"] for d in deployments} >= {"greeting-py", "time-display-py"}
    for obj in deployments + kube.objects("CronJob", PROD) + kube.objects("Job", PROD):
        for image in images(obj):
            # pinned by digest, pushed by a build that succeeded before anything referenced it
            assert re.fullmatch(rf"{REGISTRY}/functions@sha256:[0-9a-f]{{64}}", image), image
            assert image in kube.pushed_images
    assert kube.build_violations == []
    # one kaniko Job per build tag, each reading a context that holds the function's files
    builds = kube.objects("Job", NAMESPACE)
    tags = {f["build_tag"] for f in harness.store.functions("prod") if f["build_tag"]}
    assert {b["metadata"]["name"] for b in builds} == {build_job_name(t) for t in tags}
    for tag in tags:
        members = kube.build_contexts[f"contexts/{tag}.tar.gz"]
        assert "Dockerfile" in members and any(m.startswith("function/") for m in members)
    # the job's result (the log's last line) reached its dependent's env
    display = kube.get("Deployment", PROD, "time-display-py")
    env = {
        e["name"]: e.get("value")
        for e in display["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["JOB_TIME"] == '{"utc": "2026-12-01T00:00:00Z"}'
    # the status store says what the cluster says
    wait_for(
        lambda: harness.sync() and harness.function("greeting-py")["phase"] == "Ready", "Ready"
    )
    notes = harness.function("notes-py")
    assert notes["phase"] == "Pending"
    assert 'CreateContainerConfigError: secret "notes-db" not found' in notes["message"]
    sql = harness.store.job_run("prod", "notes-create-table-py", 1)
    assert sql["phase"] == "Failed" and "notes-db" in sql["error"]


def test_a_sync_with_no_change_makes_no_write(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("two", {**function_folder("alpha"), **function_folder("beta")})
    harness = harness_for(repo)
    kube.reset_counts()
    harness.sync()
    # the environment's namespace and policy once, though its functions deploy in parallel
    first = kube.counts()["writes"]
    assert first[("apply", "Namespace")] == 1 and first[("apply", "NetworkPolicy")] == 1
    wait_for(lambda: harness.sync() and harness.function("alpha")["phase"] == "Ready", "Ready")
    kube.reset_counts()
    harness.sync()
    assert writes(kube) == {}
    # the view is kept by watches: a pass with nothing new to read asks nothing
    assert requests(kube) == 0, kube.counts()["requests"]


def test_one_change_in_200_functions_is_one_build_and_one_deployment_write(
    kube, harness_for, tmp_path
):
    repo = WorkRepo(tmp_path / "repo")
    files: dict[str, str] = {}
    for i in range(200):
        files.update(function_folder(f"fn-{i:03d}", text=f"v{i}"))
    repo.commit("200", files)
    harness = harness_for(repo)
    # 200 builds may take more than one pass's patience on a busy machine
    wait_for(lambda: harness.sync() and len(kube.objects("Deployment", PROD)) == 200, "200", 60)
    kube.reset_counts()
    old_tag = harness.function("fn-123")["build_tag"]
    repo.commit("one", {"fn-123/main.py": HANDLER % "changed"})

    # on a busy machine the build may outlast one pass: the passes that follow
    # must neither build it again nor write anything else
    def new_version_deployed() -> bool:
        harness.sync()
        tag = harness.function("fn-123")["build_tag"]
        image = images(kube.get("Deployment", PROD, "fn-123"))[0]
        return tag != old_tag and image == harness.backend.builds.image(tag)

    wait_for(new_version_deployed, "fn-123's new version deployed", 60)
    harness.sync()
    assert creates(kube, "Job") == 1  # the one kaniko build
    # fn-123's Deployment, and its previous revision kept runnable beside it, at zero
    assert kube.counts()["writes"].get(("apply", "Deployment"), 0) == 2
    assert kube.counts()["writes"].get(("apply", "Service"), 0) == 1
    kept = kube.objects("Deployment", PROD)
    assert len(kept) == 201 and any(d["metadata"]["name"].startswith("fn-123-rev-") for d in kept)


def test_a_removed_function_prunes_only_its_objects(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("two", {**function_folder("alpha"), **function_folder("beta")})
    harness = harness_for(repo)
    harness.sync()
    # an object another tool made in the same namespace is never touched
    client = KubeClient.from_config(str(kube.kubeconfig), calls=None)
    client.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "someone-elses", "namespace": PROD},
            "spec": {"ports": [{"port": 80}]},
        }
    )
    repo.commit("drop beta", {"beta/sless.yaml": None, "beta/main.py": None})
    harness.sync()
    assert {d["metadata"]["name"] for d in kube.objects("Deployment", PROD)} == {"alpha"}
    services = {s["metadata"]["name"] for s in kube.objects("Service", PROD)}
    assert services == {"alpha", "someone-elses"}
    assert harness.store.function("prod", "beta") is None
    assert kube.get("Namespace", None, PROD) is not None


def test_a_failed_build_keeps_the_previous_version_and_keeps_its_log_out_of_the_message(
    kube, harness_for, tmp_path
):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("one", function_folder("alpha"))
    harness = harness_for(repo)
    harness.sync()
    before = images(kube.get("Deployment", PROD, "alpha"))
    repo.commit("break", {"alpha/main.py": HANDLER % "broken"})
    harness.reconciler.load.run(harness.reconciler.source.snapshot())
    new_tag = harness.reconciler.context.desired.functions["alpha"].build_tag
    kube.fail_build(new_tag, "INFO step 3/4\nerror building image: pip exited 1\n")
    harness.sync()
    assert images(kube.get("Deployment", PROD, "alpha")) == before
    record = harness.function("alpha")
    assert record["phase"] == "Failed"
    # what the build printed is the function's code talking: only the build log shows it
    assert record["message"] == "build failed (exit 1)"
    assert "pip exited 1" in harness.store.build(new_tag)["log"]
    assert not any(new_tag in image for image in kube.pushed_images)


def test_a_restarted_reconciler_adopts_the_build_job_it_left_running(
    kube, harness_for, tmp_path, s3_server
):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("one", function_folder("alpha"))
    first = harness_for(repo, "first")
    # the first reconciler created the build (context and Job), then died
    desired = first.reconciler.load.run(first.reconciler.source.snapshot())
    fn = desired.functions["alpha"]
    from gitops_sless.kube.contexts import build_context
    from gitops_sless.kube.renderer import build_job

    contexts = first.backend.builds.contexts
    key = contexts.key(fn.build_tag)
    contexts.upload_if_absent(key, build_context(fn, first.reconciler.source.snapshot()))
    KubeClient.from_config(str(kube.kubeconfig), calls=None).create(
        build_job(fn, first.backend.config, contexts.presigned_get(key))
    )
    first.close()
    kube.reset_counts()
    second = harness_for(repo, "second")
    second.sync()
    assert creates(kube, "Job") == 0  # waited for the same Job
    assert len(kube.objects("Job", NAMESPACE)) == 1
    assert kube.get("Deployment", PROD, "alpha") is not None


def test_a_reconciler_with_an_empty_state_folder_builds_runs_and_writes_nothing(
    kube, harness_for, tmp_path
):
    repo = sample_repo(tmp_path)
    kube.set_job_log(PROD, "get-time-py-run-1", '{"utc": "2026-12-01T00:00:00Z"}\n')
    first = harness_for(repo, "first")
    first.sync()
    wait_for(lambda: first.sync() and first.function("greeting-py")["phase"] == "Ready", "Ready")
    first.close()
    kube.reset_counts()
    second = harness_for(repo, "empty")
    result = second.sync()
    assert writes(kube) == {}, writes(kube)
    assert result.plan is not None and not result.plan.builds and not result.plan.jobs
    assert second.function("greeting-py")["phase"] == "Ready"
    assert second.function("greeting-py")["revision"] == repo.head()
    run = second.store.job_run("prod", "get-time-py", 1)
    assert run["phase"] == "Succeeded" and "2026-12-01" in run["result"]


def test_injected_conflicts_and_server_errors_converge(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("one", function_folder("alpha"))
    kube.inject("apply", "Deployment", 409, times=2)
    kube.inject("create", "Job", 500, times=1)
    kube.inject("list", "Deployment", 429, times=1, retry_after=1)
    harness = harness_for(repo)
    harness.sync()
    assert kube.get("Deployment", PROD, "alpha") is not None

    def converged() -> bool:  # converged means Ready, not merely applied
        return (
            harness.sync().result == "Succeeded" and harness.function("alpha")["phase"] == "Ready"
        )

    wait_for(converged, "alpha Ready after the injected failures")


def test_a_missing_secret_shows_the_kubelets_reason_until_it_exists(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    manifest = (
        "functions:\n  - name: alpha\n    runtime: python3.11\n    entrypoint: main.handler\n"
        "    env:\n      DSN: {secret: alpha-db, key: dsn}\n    triggers:\n      - type: http\n"
    )
    repo.commit("one", {"alpha/sless.yaml": manifest, "alpha/main.py": HANDLER % "x"})
    harness = harness_for(repo)
    harness.sync()
    record = wait_for(
        lambda: (
            harness.sync()
            and "CreateContainerConfigError" in (harness.function("alpha")["message"] or "")
            and harness.function("alpha")
        ),
        "the reason",
    )
    assert record["phase"] == "Pending"
    assert 'secret "alpha-db" not found' in record["message"]
    client = KubeClient.from_config(str(kube.kubeconfig), calls=None)
    client.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "alpha-db", "namespace": PROD},
            "stringData": {"dsn": "postgres://x"},
        }
    )
    wait_for(lambda: harness.sync() and harness.function("alpha")["phase"] == "Ready", "Ready")


def test_a_commit_that_declares_nothing_does_not_empty_the_environment(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("two", {**function_folder("alpha"), **function_folder("beta")})
    harness = harness_for(repo)
    ready = lambda: all(harness.function(n)["phase"] == "Ready" for n in ("alpha", "beta"))  # noqa: E731
    wait_for(lambda: harness.sync() and ready(), "both Ready")
    repo.git("rm", "-rq", "alpha", "beta")
    repo.commit("everything gone", {"README.md": "moved elsewhere\n"})
    result = harness.sync()
    assert result.error and "refused to prune all 2 functions" in result.error
    assert len(kube.objects("Deployment", PROD)) == 2
    # what still runs is still shown, with the refusal as the reason
    for name in ("alpha", "beta"):
        record = harness.function(name)
        assert record["phase"] == "Ready", record
        assert "refused to prune all 2 functions" in record["message"]
    harness.reconciler.allow_empty = True
    assert harness.sync().error is None
    assert kube.objects("Deployment", PROD) == []


def test_a_hand_edit_is_put_back(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("one", function_folder("alpha"))
    harness = harness_for(repo)
    harness.sync()
    client = KubeClient.from_config(str(kube.kubeconfig), calls=None)
    client.request(
        "patch",
        "Deployment",
        "PATCH",
        "/apis/apps/v1/namespaces/sless-prod/deployments/alpha",
        {"fieldManager": "kubectl-edit"},
        {"spec": {"replicas": 5}},
        "application/merge-patch+json",
    )
    assert kube.get("Deployment", PROD, "alpha")["spec"]["replicas"] == 5
    harness.sync()
    assert kube.get("Deployment", PROD, "alpha")["spec"]["replicas"] == 1


def test_cron_runs_show_as_invocations_and_crash_loops_as_failed(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    manifest = (
        "functions:\n  - name: tick\n    runtime: python3.11\n    entrypoint: main.handler\n"
        "    triggers:\n      - type: cron\n        schedule: '*/5 * * * *'\n"
    )
    repo.commit(
        "cron",
        {"tick/sless.yaml": manifest, "tick/main.py": HANDLER % "t", **function_folder("alpha")},
    )
    harness = harness_for(repo)
    harness.sync()
    cron = kube.get("CronJob", PROD, "tick-cron-0")
    assert cron["spec"]["timeZone"] == "Etc/UTC" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    kube.fire_cronjob(PROD, "tick-cron-0")
    wait_for(lambda: harness.sync() and harness.cron_runs, "a cron run")
    assert harness.cron_runs[0].function == "tick" and harness.cron_runs[0].ok
    kube.crash_loop(PROD, "alpha", reason="OOMKilled", exit_code=137)
    record = wait_for(
        lambda: (
            harness.sync()
            and harness.function("alpha")["phase"] == "Failed"
            and harness.function("alpha")
        ),
        "Failed",
    )
    assert "OOMKilled" in record["message"] and "OOMKilled" in record["last_exit"]


def test_a_422_is_a_permanent_error_reported_on_the_function(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("two", {**function_folder("alpha"), **function_folder("beta")})
    now = [time.time()]
    harness = harness_for(repo, clock=lambda: now[0])
    kube.inject("apply", "Deployment", 422, times=1)
    harness.sync()
    failed = [r for r in harness.store.functions("prod") if r["phase"] == "Failed"]
    assert len(failed) == 1, harness.store.functions("prod")
    # the API server's own message, not retried (one refusal made one failure)
    assert "injected failure 422" in failed[0]["message"]
    assert kube.counts()["requests"][("apply", "Deployment")] == 2
    # the next pass backs off (CrashLoopBackOff: 10 s), then applies it again and it deploys
    harness.sync()
    assert kube.counts()["requests"][("apply", "Deployment")] == 2
    held = harness.function(failed[0]["name"])
    assert held["phase"] == "Failed" and held["next_retry"] == now[0] + 10
    now[0] += 10
    harness.sync()
    assert len(kube.objects("Deployment", PROD)) == 2
    name = failed[0]["name"]
    wait_for(
        lambda: harness.sync() and harness.function(name)["phase"] == "Ready",
        f"{name} Ready once applied again",
    )


def test_the_client_refuses_calls_outside_its_table(kube):
    client = KubeClient.from_config(str(kube.kubeconfig))
    client.own_namespace = NAMESPACE
    kube.reset_counts()
    with pytest.raises(Forbidden, match="get Deployment: not a call this reconciler makes"):
        client.request("get", "Deployment", "GET", "/apis/apps/v1/namespaces/x/deployments/y")
    with pytest.raises(Forbidden, match=f"only in the namespace {NAMESPACE}"):
        client.list("ConfigMap", PROD)
    assert not any(kube.counts()["requests"].values())  # refused before any request


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        ("hello from the handler\nnot json at all\n", "the runner's output is not JSON"),
        ('"' + "x" * 200_001 + '"\n', "bytes; at most 200000 are kept"),
    ],
    ids=["not-json", "too-large"],
)
def test_a_job_result_that_cannot_be_kept_fails_the_run_with_why(
    kube, harness_for, tmp_path, log, expected
):
    repo = WorkRepo(tmp_path / "repo")
    manifest = (
        "functions:\n  - name: once\n    runtime: python3.11\n    entrypoint: main.handler\n"
        "    jobs:\n      - name: seed\n        runId: 1\n"
    )
    repo.commit("job", {"once/sless.yaml": manifest, "once/main.py": HANDLER % "j"})
    kube.set_job_log(PROD, "seed-run-1", log)
    harness = harness_for(repo)
    harness.sync()
    run = harness.store.job_run("prod", "seed", 1)
    assert run["phase"] == "Failed" and expected in run["error"]
    # recorded on the Job: a restarted reconciler does not run it again
    job = kube.get("Job", PROD, "seed-run-1")
    assert expected in job["metadata"]["annotations"]["gitops-sless.dev/error"]


def test_every_sample_function_becomes_ready_on_kubernetes(kube, harness_for, tmp_path):
    """The Kubernetes twin of the local sample: with its secret and its jobs' results,
    every function of sample-repo/ is Ready and the pass converges (Succeeded)."""
    repo = sample_repo(tmp_path)
    for job in ("get-time-py", "get-time-js", "sum-numbers-py", "sum-numbers-js"):
        kube.set_job_log(PROD, f"{job}-run-1", '{"utc": "2026-12-01T00:00:00Z", "sum": 3}\n')
    for job in ("notes-create-table-py", "notes-create-table-js"):
        kube.set_job_log(PROD, f"{job}-run-1", '{"created": true}\n')
    # the operator's part: the environment's namespace and the notes functions' secret
    client = KubeClient.from_config(str(kube.kubeconfig), calls=None)
    client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": PROD}})
    client.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "notes-db", "namespace": PROD},
            "stringData": {"dsn": "postgres://notes@db.invalid/notes"},
        }
    )
    harness = harness_for(repo)

    def converged() -> bool:
        result = harness.sync()
        records = harness.store.functions("prod")
        ready = all(r["phase"] == "Ready" for r in records)
        return bool(records) and ready and result.result == "Succeeded"

    wait_for(converged, "every sample function Ready and the pass Succeeded", 60)
    records = harness.store.functions("prod")
    assert len(records) == 20, sorted(r["name"] for r in records)  # validate's count


def test_a_job_only_function_beside_an_http_one_becomes_ready(kube, harness_for, tmp_path):
    """A function with jobs and no trigger has no object of its own: once applied it is
    Ready (as on the local backend), even beside functions the cluster reports on."""
    repo = WorkRepo(tmp_path / "repo")
    job_only = (
        "functions:\n  - name: once\n    runtime: python3.11\n    entrypoint: main.handler\n"
        "    jobs:\n      - name: seed\n        runId: 1\n"
    )
    repo.commit(
        "two",
        {**function_folder("alpha"), "once/sless.yaml": job_only, "once/main.py": HANDLER % "j"},
    )
    kube.set_job_log(PROD, "seed-run-1", '{"seeded": true}\n')
    harness = harness_for(repo)
    phases = lambda: {n: (harness.function(n) or {}).get("phase") for n in ("alpha", "once")}  # noqa: E731
    wait_for(lambda: harness.sync() and phases() == {"alpha": "Ready", "once": "Ready"}, "Ready")
    assert harness.store.job_run("prod", "seed", 1)["phase"] == "Succeeded"
    assert harness.function("once")["message"] is None  # not "starting: not seen running yet"


def test_a_build_pod_that_cannot_start_fails_with_the_kubelets_reason(kube, s3_server, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("one", function_folder("alpha"))
    unpullable = settings(kube.kubeconfig, s3_server.config(), kaniko_image="registry.test/nope:1")
    harness = make(repo, tmp_path / "state", unpullable)
    try:
        harness.sync()
        record = harness.function("alpha")
        assert record["phase"] == "Failed"
        assert "build pod cannot start: ErrImagePull" in record["message"]
        assert kube.objects("Job", NAMESPACE) == []  # the stuck Job is deleted, retried later
        assert kube.get("Deployment", PROD, "alpha") is None
    finally:
        harness.close()


def test_the_dashboard_counts_the_replicas_the_deployment_has_available(
    kube, harness_for, tmp_path
):
    """One route through the API server stands for every pod: the count is the cluster's."""
    folder = function_folder("pair")
    folder["pair/sless.yaml"] += "    replicas: 2\n"
    repo = WorkRepo(tmp_path / "functions")
    repo.commit("two replicas", folder)
    harness = harness_for(repo)
    wait_for(lambda: harness.sync() and harness.function("pair")["phase"] == "Ready", "Ready")
    available = kube.get("Deployment", PROD, "pair")["status"]["availableReplicas"]
    assert available == 2
    pages = Pages(harness.reconciler, harness.store, str(repo.path), "main", None)
    row = re.search(r'<tr id="fn-prod-pair".*?</tr>', pages.index().body.decode(), re.S)
    assert row is not None and 'data-label="Replicas">2/2</td>' in row.group(0), row.group(0)
