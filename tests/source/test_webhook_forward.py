"""A webhook that reaches a replica which does not lead reaches the leader at once.

Two ``serve --backend kubernetes`` processes share one test API server; one holds
the Lease and writes its address into it. Polling is an hour apart, so only the
follower handing the delivery on can explain a pass on the leader.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil

import pytest

from gitops_sless.kube.client import KubeClient
from gitops_sless.kube.leader import LEADER_URL

from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, kube_env
from ..kubeapi import FakeKube
from ..paths import SAMPLE
from ..sless_server import WEBHOOK_SECRET, SlessServer

PUSH = json.dumps({"ref": "refs/heads/main"}).encode()


def github(body: bytes, delivery: str, secret: str = WEBHOOK_SECRET) -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {
        "X-Hub-Signature-256": f"sha256={digest}",
        "X-GitHub-Event": "push",
        "X-GitHub-Delivery": delivery,
        "Content-Type": "application/json",
    }


@pytest.fixture
def kube(fake_kube: FakeKube) -> FakeKube:
    KubeClient.from_config(str(fake_kube.kubeconfig), calls=None).create(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    )
    return fake_kube


def webhook_passes(server: SlessServer) -> list[dict]:
    return [s for s in server.syncs() if s["trigger"].startswith("webhook")]


def test_a_webhook_to_a_follower_is_handed_to_the_leader_which_syncs_at_once(
    kube, s3_server, tmp_path
):
    repo = WorkRepo(tmp_path / "functions")
    shutil.copytree(SAMPLE / "greeting" / "python", repo.path / "greeting", dirs_exist_ok=True)
    repo.commit("greeting")
    env = kube_env(kube.kubeconfig, s3_server)
    args = ["--backend", "kubernetes"]
    leader = SlessServer(str(repo.path), tmp_path / "a", env=env, args=args).start()
    follower = SlessServer(str(repo.path), tmp_path / "b", env=env, args=args)
    try:
        follower.start(wait_for_sync=False)
        lease = kube.get("Lease", NAMESPACE, "gitops-sless")
        assert lease["metadata"]["annotations"][LEADER_URL] == leader.base
        follower.wait(lambda: f"webhooks go to {leader.base}" in follower.output(), "the leader")

        forged = follower.client.post(
            "/api/v1/webhooks/github", content=PUSH, headers=github(PUSH, "d-1", secret="x")
        )
        assert forged.status_code == 401  # refused where it arrived: never handed on
        assert "webhook.forwarded" not in follower.output() and not webhook_passes(leader)

        head = repo.commit("a second commit", {"greeting/NOTE.txt": "v2\n"})
        answer = follower.client.post(
            "/api/v1/webhooks/github", content=PUSH, headers=github(PUSH, "d-2")
        )
        assert answer.status_code == 202 and answer.json()["accepted"], answer.text
        passes = leader.wait(
            lambda: [s for s in webhook_passes(leader) if s["revision"] == head],
            "the leader's pass for the webhook",
            timeout=60,
        )
        assert passes[0]["trigger"] == "webhook:github"
        assert "webhook.forwarded" in follower.output()
        assert not webhook_passes(follower)  # the follower ran nothing itself

        # the forge sends the same delivery again: the leader knows it and says so
        again = follower.client.post(
            "/api/v1/webhooks/github", content=PUSH, headers=github(PUSH, "d-2")
        )
        assert again.status_code == 200 and again.json()["ignored"] == "duplicate delivery"
        assert len(webhook_passes(leader)) == 1
    finally:
        follower.stop()
        leader.stop()
