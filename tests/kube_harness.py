"""A reconciler on the Kubernetes backend, against the test API server and a real S3 server.

Used in process (the test can count the API server's requests and drive its
kubelet) by the scenario tests, and the same way against a real cluster when
``SLESS_TEST_KUBECONFIG`` is set.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gitops_sless.kube.backend import KubeBackend
from gitops_sless.kube.connect import connect
from gitops_sless.kube.settings import KubeSettings
from gitops_sless.reconciler import PassResult, Reconciler
from gitops_sless.source.snapshot import Snapshot, open_snapshot
from gitops_sless.state.routes import RouteTable
from gitops_sless.state.store import Store

from .gitserver import WorkRepo

NAMESPACE = "gitops-sless"
REGISTRY = "registry.test/team"


class RepoSource:
    """The HEAD of a work repository, read straight from git (no mirror)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fetch(self) -> None:
        return None

    def snapshot(self, commit: str | None = None) -> Snapshot:
        return open_snapshot(self.path, "HEAD")


@dataclass
class Harness:
    repo: WorkRepo
    reconciler: Reconciler
    backend: KubeBackend
    store: Store
    routes: RouteTable
    cron_runs: list[Any]

    def sync(self) -> PassResult:
        result = self.reconciler.sync("test")
        assert result.error is None or "refused" in result.error or result.plan, result.error
        return result

    def function(self, name: str, env: str | None = None) -> dict[str, Any]:
        record = self.store.function(env or self.reconciler.env, name)
        assert record is not None, f"{name} is not in the store"
        return record

    def writes(self) -> int:
        """Writes this reconciler's client made (counted by the client: works on any cluster)."""
        verbs = {"apply", "create", "patch", "delete", "update", "status"}
        return sum(n for (verb, _), n in self.backend.client.counts().items() if verb in verbs)

    def close(self) -> None:
        self.reconciler.stop()
        self.backend.close()  # its watches
        self.store.close()


def kube_env(kubeconfig: Path | str, s3: Any, **changes: str) -> dict[str, str]:
    """The environment ``serve --backend kubernetes`` reads, for a test API server and S3."""
    env = {
        "KUBECONFIG": str(kubeconfig),
        "SLESS_NAMESPACE": NAMESPACE,
        "SLESS_REGISTRY": REGISTRY,
        "SLESS_S3_ENDPOINT": s3.endpoint,
        "SLESS_S3_BUCKET": s3.bucket,
        "SLESS_S3_REGION": s3.region,
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
    }
    env.update(changes)
    return env


def settings(kubeconfig: Path | str, s3: Any, **changes: Any) -> KubeSettings:
    values: dict[str, Any] = {
        "namespace": NAMESPACE,
        "registry": REGISTRY,
        "s3": s3,
        "kubeconfig": str(kubeconfig),
        "build_timeout": 120,
    }
    values.update(changes)
    return KubeSettings(**values)


def make(
    repo: WorkRepo,
    state_dir: Path,
    kube_settings: KubeSettings,
    *,
    allow_empty: bool = False,
    build_retry_sec: float = 300.0,
    env: str = "prod",
    clock: Callable[[], float] = time.time,
    keep_revisions: int | None = None,
) -> Harness:
    routes = RouteTable()
    cron_runs: list[Any] = []
    backend = connect(
        kube_settings, routes, on_cron=cron_runs.append, build_retry_sec=build_retry_sec
    )
    backend.builds.poll_sec = 0.2
    backend.jobs.poll_sec = 0.2
    state_dir.mkdir(parents=True, exist_ok=True)
    store = Store(state_dir / "status.db")
    reconciler = Reconciler(
        RepoSource(repo.path),
        backend,
        store,
        env=env,
        routes=routes,
        workers=16,
        allow_empty=allow_empty,
        build_retry_sec=build_retry_sec,
        clock=clock,
        **({"keep_revisions": keep_revisions} if keep_revisions is not None else {}),
    )
    return Harness(repo, reconciler, backend, store, routes, cron_runs)
