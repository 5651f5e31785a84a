"""Two ``serve --backend kubernetes`` processes against one API server: one leads, both serve.

The leader holds the Lease ``gitops-sless`` and is the only one to write; the
other copies the ``Function`` resources into its own store and routes. Killing
the leader with SIGKILL hands over within one lease duration (15 s), and the
new leader converges a new commit without creating any Job twice.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ..gitserver import WorkRepo, init_bare
from ..kube_harness import NAMESPACE, kube_env
from ..kubeapi import FakeKube
from ..sless_server import SlessServer
from .test_kube_backend import function_folder
from .test_kube_functions import PROD, install_crd


def holder(kube: FakeKube) -> str | None:
    lease = kube.get("Lease", NAMESPACE, "gitops-sless")
    return (lease or {}).get("spec", {}).get("holderIdentity") or None


def wait_for(check: Any, what: str, timeout: float = 40) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def functions(server: SlessServer) -> list[dict[str, Any]]:
    return server.client.get("/api/v1/environments/prod/functions").json()


@pytest.fixture
def kube(fake_kube):
    client = install_crd(fake_kube.kubeconfig)
    client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    return fake_kube


def test_one_leader_two_servers_and_a_handover(kube, s3_server, tmp_path: Path):
    work = WorkRepo(tmp_path / "work")
    work.commit("two", {**function_folder("alpha"), **function_folder("beta")})
    bare = init_bare(tmp_path / "functions.git")
    work.push(str(bare))
    env = kube_env(kube.kubeconfig, s3_server)
    servers = [
        SlessServer(
            str(bare),
            tmp_path / f"state-{i}",
            env={**env, "POD_NAME": f"replica-{i}"},
            poll_interval=1,
            args=["--backend", "kubernetes"],
        )
        for i in range(2)
    ]
    try:
        for server in servers:
            server.start(wait_for_sync=False)
        lead = wait_for(lambda: holder(kube), "a leader")
        leader = next(s for s in servers if lead.startswith(s.extra_env["POD_NAME"]))
        follower = next(s for s in servers if s is not leader)

        seen: list[Any] = []

        def same_view() -> bool:
            mine, theirs = functions(leader), functions(follower)
            seen[:] = [mine, theirs]
            ready = [f["phase"] for f in mine] == ["Ready", "Ready"]
            return ready and mine == theirs

        try:
            wait_for(same_view, "both replicas to list the same Ready functions")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: leader {seen[0]}, follower {seen[1]}") from None
        for server in servers:
            assert server.client.get("/readyz").status_code == 200
            answer = server.call("alpha", "/hi")
            assert answer.status_code == 200 and answer.json()["service"] == "alpha"
        # only the leader wrote: the follower's replica name holds no lease and made nothing
        assert lead.startswith(leader.extra_env["POD_NAME"])

        leader.kill()  # SIGKILL: no release of the lease
        wait_for(  # once the lease expires: test_kube_leader shows it is never sooner
            lambda: (h := holder(kube)) and h.startswith(follower.extra_env["POD_NAME"]),
            "the follower to take the lease",
            timeout=30,
        )
        head = work.commit("change", {"alpha/main.py": "def handler(e, c):\n    return 2\n"})
        work.push(str(bare))
        wait_for(
            lambda: (
                (f := follower.function("alpha"))
                and f["revision"] == head
                and f["phase"] == "Ready"
            ),
            "the new leader to converge the new commit",
            timeout=60,
        )
        jobs = kube.objects("Job", NAMESPACE) + kube.objects("Job", PROD)
        creates = kube.counts()["writes"].get(("create", "Job"), 0)
        # alpha and beta share their files (only sless.yaml differs): one build, then alpha's
        # new tag; none twice
        assert creates == len(jobs) == 2
    finally:
        for server in servers:
            server.stop()
